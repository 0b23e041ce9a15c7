"""The raw baselines' memory, of the kind the services' caches are: host memory (on huge pages
unless told otherwise) or, with device cuda, rank r's GPU (cuda:r, as the services place ranks)."""

from __future__ import annotations

import torch

from shared.cache.regions import region_tensor

DEVICES = ("cpu", "cuda")


def rank_device(device: str, rank: int) -> torch.device:
    """Where rank `rank`'s memory lives for `--device device`."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")


def region_buffer(nbytes: int, device: str, rank: int, *, huge_pages: bool = True) -> torch.Tensor:
    """A zero-filled uint8 tensor of `nbytes` for rank `rank`, every page touched now: the
    services' cache regions (`shared.cache.regions.region_tensor`)."""
    return region_tensor(nbytes, rank_device(device, rank), huge_pages=huge_pages)


def cuda_ready(ranks: int) -> str | None:
    """Why `ranks` ranks cannot each have a GPU here (None: they can)."""
    if not torch.cuda.is_available():
        return "no usable CUDA device here (torch.cuda.is_available() is false)"
    if torch.cuda.device_count() < ranks:
        return f"{ranks} ranks need {ranks} GPUs (rank r on cuda:r), this machine has {torch.cuda.device_count()}"
    return None
