"""Typed views of one rank's cache regions: the FA view and the Mamba view over the same bytes.

The page layout is the layout's (see `shared.layout.page`); this module only turns it into
torch views, so engines read and write K/V, conv and SSM state where the transfer plan expects
them. No copies: every view aliases the registered region.
"""

from __future__ import annotations

import torch

from shared.cache.regions import RankCache
from shared.layout.page import EngineLayout

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(TORCH_DTYPES)}") from None


class RankViews:
    """FA and Mamba views of every region of one rank."""

    def __init__(self, layout: EngineLayout, cache: RankCache) -> None:
        if cache.page_bytes != layout.page_bytes or cache.num_regions != layout.num_regions:
            raise ValueError(
                f"cache ({cache.num_regions} regions of {cache.page_bytes} B pages) does not match the layout "
                f"({layout.num_regions} regions of {layout.page_bytes} B pages)"
            )
        self.layout = layout
        self.cache = cache
        shapes = layout.shapes
        spec = layout.spec
        n_log = cache.num_blocks
        n_phys = layout.num_kernel_blocks(n_log)
        kv_dtype = torch_dtype(spec.kv_dtype)
        # FA: [N_phys, *EngineLayout.fa_block_shape] (HND per kernel block).
        self.fa = [region.view(kv_dtype).view(n_phys, *layout.fa_block_shape) for region in cache.regions]
        # Mamba: per logical block, conv DS (conv_dim, conv_rows) then the SSM state (offsets: RankShapes).
        conv_dtype, ssm_dtype = torch_dtype(spec.conv_dtype), torch_dtype(spec.ssm_dtype)
        conv_span = slice(shapes.conv_offset, shapes.conv_offset + shapes.conv_bytes)
        ssm_span = slice(shapes.ssm_offset, shapes.ssm_offset + shapes.ssm_bytes)
        self.conv = []
        self.ssm = []
        for r in range(cache.num_regions):
            pages = cache.blocks(r)  # [N_log, P] uint8
            self.conv.append(pages[:, conv_span].view(conv_dtype).view(n_log, shapes.conv_dim, shapes.conv_rows))
            self.ssm.append(pages[:, ssm_span].view(ssm_dtype).view(n_log, *shapes.ssm_shape))
