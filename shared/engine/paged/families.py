"""Build a `Model` from a checkpoint's config and weights, family by family.

Each builder names the checkpoint's tensors and reads the config fields the family's modeling
code reads; nothing of transformers' modules is instantiated. A family without a builder is
refused at load with the engines that serve it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shared.engine.paged.attention import Attention, Rope
from shared.engine.paged.ffn import Mlp, Moe, activation
from shared.engine.paged.gdn import GatedDeltaNet
from shared.engine.paged.mamba1 import Mamba1
from shared.engine.paged.mamba2 import Mamba2
from shared.engine.paged.model import SSM_MIXERS, Layer, Model, Norm, Parallel, Sublayer
from shared.engine.paged.routers import GroupedSigmoidRouter, SoftmaxRouter
from shared.engine.paged.support import ALL_HYBRID_FAMILIES, PAGED_ROPE_TYPES, SEQUENCE_DEPENDENT_ROPE_TYPES, rope_type
from shared.engine.paged.weights import Weights


class UnsupportedFamily(ValueError):
    """The paged engine has no implementation of this model family."""


def _rope(config: Any, head_dim: int, device: torch.device) -> Rope:
    params = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope_type(params)
    if kind == "default":
        base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        factor = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
        return Rope(inv_freq.to(device))
    if kind not in PAGED_ROPE_TYPES:
        reason = SEQUENCE_DEPENDENT_ROPE_TYPES.get(kind, "not implemented")
        raise UnsupportedFamily(f"rope_type {kind!r} ({reason}) is not computed by the paged engine (use --engine hf)")
    # transformers' own initialisation, called as the family's rotary embedding calls it: the
    # same frequencies and attention factor as the hf engine by construction.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, device)
    return Rope(inv_freq.to(device=device, dtype=torch.float32), scaling=float(attention_factor))


def _attention(config: Any, w: Weights, prefix: str, *, rope: bool, scaling: float | None = None) -> Attention:
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return Attention(
        q_proj=w.get(prefix + "q_proj.weight"),
        k_proj=w.get(prefix + "k_proj.weight"),
        v_proj=w.get(prefix + "v_proj.weight"),
        o_proj=w.get(prefix + "o_proj.weight"),
        q_bias=w.maybe(prefix + "q_proj.bias"),
        k_bias=w.maybe(prefix + "k_proj.bias"),
        v_bias=w.maybe(prefix + "v_proj.bias"),
        o_bias=w.maybe(prefix + "o_proj.bias"),
        num_heads=int(config.num_attention_heads),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=head_dim,
        scaling=head_dim**-0.5 if scaling is None else float(scaling),
        rope=_rope(config, head_dim, w.device) if rope else None,
    )


def _mamba2(
    w: Weights,
    prefix: str,
    *,
    heads: int,
    head_dim: int,
    groups: int,
    d_state: int,
    chunk: int,
    eps: float,
    dt_limit: tuple[float, float],
    gated_norm: bool = True,
) -> Mamba2:
    conv = w.get(prefix + "conv1d.weight")
    # transformers computes A = -exp(A_log.float()) from the parameter in the compute dtype.
    a_log = w.get(prefix + "A_log").float()
    return Mamba2(
        in_proj=w.get(prefix + "in_proj.weight"),
        in_bias=w.maybe(prefix + "in_proj.bias"),
        conv_weight=conv.reshape(conv.shape[0], conv.shape[-1]).contiguous(),
        conv_bias=w.maybe(prefix + "conv1d.bias"),
        dt_bias=w.get(prefix + "dt_bias"),
        A=-torch.exp(a_log),
        D=w.get(prefix + "D"),
        out_proj=w.get(prefix + "out_proj.weight"),
        out_bias=w.maybe(prefix + "out_proj.bias"),
        num_heads=heads,
        head_dim=head_dim,
        n_groups=groups,
        d_state=d_state,
        chunk_size=chunk,
        norm_weight=w.get(prefix + "norm.weight") if gated_norm else None,
        norm_eps=eps,
        norm_groups=groups,
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
    )


def _conv_shapes(layers: list[Layer]) -> dict[int, tuple[int, int]]:
    shapes = {}
    for i, layer in enumerate(layers):
        for sub in layer.sublayers:
            mixer = sub.mixer.mamba if isinstance(sub.mixer, Parallel) else sub.mixer
            if isinstance(mixer, SSM_MIXERS):
                shapes[i] = (mixer.conv_dim, int(mixer.conv_weight.shape[1]) - 1)
    return shapes


def _head(config: Any, w: Weights, embed_name: str) -> torch.Tensor:
    if w.has("lm_head.weight"):
        return w.get("lm_head.weight")
    if getattr(config, "tie_word_embeddings", False):
        return w.get(embed_name)
    return w.get("lm_head.weight")  # raises: missing


def _layer_kind(name: str) -> str:
    return {
        "linear_attention": "mamba",
        "full_attention": "attention",
        "M": "mamba",
        "*": "attention",
        "-": "mlp",
        "E": "moe",
    }.get(name, name)


def _nemotron_experts(config: Any, w: Weights, p: str) -> list[Mlp]:
    """The routed experts, stored one by one (`experts.{e}.up_proj.weight`, as published and as
    transformers saves them)."""
    act = activation(config.mlp_hidden_act)
    return [
        Mlp(up=w.get(f"{p}experts.{e}.up_proj.weight"), down=w.get(f"{p}experts.{e}.down_proj.weight"), act=act)
        for e in range(int(config.n_routed_experts))
    ]


def _nemotron_moe(config: Any, w: Weights, p: str) -> Moe:
    """transformers' NemotronHMoE: grouped sigmoid routing, non-gated experts (optionally in a
    latent width), routed outputs weighed and summed in fp32, plus the shared experts."""
    router = GroupedSigmoidRouter(
        weight=w.get(p + "gate.weight", fp32=True),
        correction_bias=w.get(p + "gate.e_score_correction_bias", fp32=True),
        top_k=int(config.num_experts_per_tok),
        num_groups=int(config.n_group),
        topk_groups=int(config.topk_group),
        normalize_topk=bool(config.norm_topk_prob),
        scaling=float(config.routed_scaling_factor),
    )
    latent = getattr(config, "moe_latent_size", None) is not None
    return Moe(
        router=router,
        experts=_nemotron_experts(config, w, p),
        shared=Mlp(
            up=w.get(p + "shared_experts.up_proj.weight"),
            down=w.get(p + "shared_experts.down_proj.weight"),
            act=activation(config.mlp_hidden_act),
        ),
        weights_in_fp32=True,
        latent_in=w.get(p + "fc1_latent_proj.weight") if latent else None,
        latent_out=w.get(p + "fc2_latent_proj.weight") if latent else None,
    )


def nemotron_h(config: Any, w: Weights) -> Model:
    eps = float(config.layer_norm_epsilon)
    layers = []
    kinds = [_layer_kind(k) for k in config.layers_block_type]
    if getattr(config, "mlp_bias", False) and any(k in ("mlp", "moe") for k in kinds):
        raise UnsupportedFamily("nemotron_h with mlp_bias is not implemented by the paged engine (use --engine hf)")
    for i, kind in enumerate(kinds):
        p = f"backbone.layers.{i}.mixer."
        mixer: Attention | Mamba2 | Mlp | Moe
        if kind == "mamba":
            mixer = _mamba2(
                w,
                p,
                heads=int(config.mamba_num_heads),
                head_dim=int(config.mamba_head_dim),
                groups=int(config.n_groups),
                d_state=int(config.ssm_state_size),
                chunk=int(config.chunk_size),
                eps=eps,
                dt_limit=(float(config.time_step_min), float("inf")),
            )
        elif kind == "attention":
            mixer = _attention(config, w, p, rope=False)
        elif kind == "mlp":
            mixer = Mlp(up=w.get(p + "up_proj.weight"), down=w.get(p + "down_proj.weight"), act=activation(config.mlp_hidden_act))
        elif kind == "moe":
            mixer = _nemotron_moe(config, w, p)
        else:
            raise UnsupportedFamily(
                f"nemotron_h layer kind {kind!r} (layer {i}) is not implemented by the paged engine (use --engine hf)"
            )
        norm = Norm(w.get(f"backbone.layers.{i}.norm.weight"), eps, weight_in_fp32=True)
        layers.append(Layer([Sublayer(norm, mixer)]))
    return Model(
        family="nemotron_h",
        dtype=w.dtype,
        device=w.device,
        embed=w.get("backbone.embeddings.weight"),
        layers=layers,
        final_norm=Norm(w.get("backbone.norm_f.weight"), eps, weight_in_fp32=True),
        lm_head=_head(config, w, "backbone.embeddings.weight"),
        conv_shape=_conv_shapes(layers),
    )


def _granite_mamba2(config: Any, w: Weights, prefix: str) -> Mamba2:
    return _mamba2(
        w,
        prefix,
        heads=int(config.mamba_n_heads),
        head_dim=int(config.mamba_d_head),
        groups=int(config.mamba_n_groups),
        d_state=int(config.mamba_d_state),
        chunk=int(config.mamba_chunk_size),
        eps=float(config.rms_norm_eps),
        dt_limit=tuple(config.time_step_limit),
    )


def bamba(config: Any, w: Weights) -> Model:
    eps = float(config.rms_norm_eps)
    act = activation(config.hidden_act)
    layers = []
    for i, kind in enumerate(_layer_kind(k) for k in config.layers_block_type):
        p = f"model.layers.{i}."
        mixer: Attention | Mamba2 = (
            _granite_mamba2(config, w, p + "mamba.") if kind == "mamba" else _attention(config, w, p + "self_attn.", rope=True)
        )
        ffn = Mlp(
            up=w.get(p + "feed_forward.up_proj.weight"),
            gate=w.get(p + "feed_forward.gate_proj.weight"),
            down=w.get(p + "feed_forward.down_proj.weight"),
            act=act,
        )
        layers.append(
            Layer(
                [
                    Sublayer(Norm(w.get(p + "input_layernorm.weight"), eps), mixer),
                    Sublayer(Norm(w.get(p + "pre_ff_layernorm.weight"), eps), ffn),
                ]
            )
        )
    return Model(
        family="bamba",
        dtype=w.dtype,
        device=w.device,
        embed=w.get("model.embed_tokens.weight"),
        layers=layers,
        final_norm=Norm(w.get("model.final_layernorm.weight"), eps),
        lm_head=_head(config, w, "model.embed_tokens.weight"),
        conv_shape=_conv_shapes(layers),
    )


def granitemoehybrid(config: Any, w: Weights) -> Model:
    eps = float(config.rms_norm_eps)
    act = activation(config.hidden_act)
    scale = float(config.residual_multiplier)
    rope = getattr(config, "position_embedding_type", None) == "rope"
    layers = []
    for i, kind in enumerate(_layer_kind(k) for k in config.layer_types):
        p = f"model.layers.{i}."
        mixer: Attention | Mamba2 = (
            _granite_mamba2(config, w, p + "mamba.")
            if kind == "mamba"
            else _attention(config, w, p + "self_attn.", rope=rope, scaling=config.attention_multiplier)
        )
        shared = Mlp(
            up=w.get(p + "shared_mlp.input_linear.weight"),
            down=w.get(p + "shared_mlp.output_linear.weight"),
            act=act,
            fused_gate=True,
        )
        ffn: Mlp | Moe = shared
        if int(getattr(config, "num_local_experts", 0) or 0) > 0:
            up, down = w.get(p + "block_sparse_moe.input_linear.weight"), w.get(p + "block_sparse_moe.output_linear.weight")
            experts = [
                Mlp(up=up[e].contiguous(), down=down[e].contiguous(), act=act, fused_gate=True) for e in range(up.shape[0])
            ]
            router = SoftmaxRouter(
                w.get(p + "block_sparse_moe.router.layer.weight"), int(config.num_experts_per_tok), softmax_after_topk=True
            )
            ffn = Moe(router=router, experts=experts, shared=shared)
        layers.append(
            Layer(
                [
                    Sublayer(Norm(w.get(p + "input_layernorm.weight"), eps), mixer, scale),
                    Sublayer(Norm(w.get(p + "post_attention_layernorm.weight"), eps), ffn, scale),
                ]
            )
        )
    return Model(
        family="granitemoehybrid",
        dtype=w.dtype,
        device=w.device,
        embed=w.get("model.embed_tokens.weight"),
        layers=layers,
        final_norm=Norm(w.get("model.norm.weight"), eps),
        lm_head=_head(config, w, "model.embed_tokens.weight"),
        embed_scale=float(config.embedding_multiplier),
        logits_divisor=float(config.logits_scaling),
        conv_shape=_conv_shapes(layers),
    )


def _falcon_mup(config: Any, mamba: Mamba2, w: Weights) -> torch.Tensor | None:
    """The per-channel multipliers of Falcon-H1's in_proj output ([z | x | B | C | dt])."""
    mults = [float(m) for m in config.ssm_multipliers]
    if all(m == 1.0 for m in mults):
        return None
    i, gn = mamba.intermediate, mamba.n_groups * mamba.d_state
    sizes = [i, i, gn, gn, mamba.in_proj.shape[0] - 2 * i - 2 * gn]
    vector = torch.cat([torch.full((n,), m) for n, m in zip(sizes, mults)])
    return vector.to(device=w.device, dtype=w.dtype)


def falcon_h1(config: Any, w: Weights) -> Model:
    eps = float(config.rms_norm_eps)
    act = activation(config.hidden_act)
    gate_mult, down_mult = (float(m) for m in config.mlp_multipliers)
    layers = []
    for i in range(int(config.num_hidden_layers)):
        p = f"model.layers.{i}."
        mamba = _mamba2(
            w,
            p + "mamba.",
            heads=int(config.mamba_n_heads),
            head_dim=int(config.mamba_d_head),
            groups=int(config.mamba_n_groups),
            d_state=int(config.mamba_d_state),
            chunk=int(config.mamba_chunk_size),
            eps=eps,
            dt_limit=tuple(config.time_step_limit),
            gated_norm=bool(config.mamba_rms_norm),
        )
        mamba.in_scale = float(config.ssm_in_multiplier)
        mamba.in_multipliers = _falcon_mup(config, mamba, w)
        mamba.falcon_norm, mamba.norm_before_gate = True, bool(config.mamba_norm_before_gate)
        attention = _attention(config, w, p + "self_attn.", rope=True)
        attention.key_scale = float(config.key_multiplier)
        mixer = Parallel(
            attention,
            mamba,
            attn_in=float(config.attention_in_multiplier),
            attn_out=float(config.attention_out_multiplier),
            ssm_out=float(config.ssm_out_multiplier),
        )
        ffn = Mlp(
            up=w.get(p + "feed_forward.up_proj.weight"),
            gate=w.get(p + "feed_forward.gate_proj.weight"),
            down=w.get(p + "feed_forward.down_proj.weight"),
            act=act,
            gate_scale=gate_mult,
            down_scale=down_mult,
        )
        layers.append(
            Layer(
                [
                    Sublayer(Norm(w.get(p + "input_layernorm.weight"), eps), mixer),
                    Sublayer(Norm(w.get(p + "pre_ff_layernorm.weight"), eps), ffn),
                ]
            )
        )
    return Model(
        family="falcon_h1",
        dtype=w.dtype,
        device=w.device,
        embed=w.get("model.embed_tokens.weight"),
        layers=layers,
        final_norm=Norm(w.get("model.final_layernorm.weight"), eps),
        lm_head=_head(config, w, "model.embed_tokens.weight"),
        embed_scale=float(config.embedding_multiplier),
        logits_scale=float(config.lm_head_multiplier),
        conv_shape=_conv_shapes(layers),
    )


def _jamba_mamba(config: Any, w: Weights, p: str) -> Mamba1:
    conv = w.get(p + "conv1d.weight")
    eps = float(config.rms_norm_eps)
    return Mamba1(
        in_proj=w.get(p + "in_proj.weight"),
        in_bias=w.maybe(p + "in_proj.bias"),
        conv_weight=conv.reshape(conv.shape[0], conv.shape[-1]).contiguous(),
        conv_bias=w.maybe(p + "conv1d.bias"),
        x_proj=w.get(p + "x_proj.weight"),
        dt_proj=w.get(p + "dt_proj.weight"),
        dt_bias=w.get(p + "dt_proj.bias"),
        A=-torch.exp(w.get(p + "A_log").float()),
        D=w.get(p + "D"),
        out_proj=w.get(p + "out_proj.weight"),
        out_bias=w.maybe(p + "out_proj.bias"),
        dt_rank=int(config.mamba_dt_rank),
        d_state=int(config.mamba_d_state),
        dt_norm=w.get(p + "dt_layernorm.weight"),
        b_norm=w.get(p + "b_layernorm.weight"),
        c_norm=w.get(p + "c_layernorm.weight"),
        norm_eps=eps,
    )


def _gated_mlp(w: Weights, p: str, act: Any) -> Mlp:
    return Mlp(up=w.get(p + "up_proj.weight"), gate=w.get(p + "gate_proj.weight"), down=w.get(p + "down_proj.weight"), act=act)


def jamba(config: Any, w: Weights) -> Model:
    eps = float(config.rms_norm_eps)
    act = activation(config.hidden_act)
    experts_per_layer = list(config.layers_num_experts or [1] * int(config.num_hidden_layers))
    layers = []
    for i, kind in enumerate(_layer_kind(k) for k in config.layers_block_type):
        p = f"model.layers.{i}."
        mixer: Attention | Mamba1 = (
            _jamba_mamba(config, w, p + "mamba.") if kind == "mamba" else _attention(config, w, p + "self_attn.", rope=False)
        )
        ffn: Mlp | Moe
        if experts_per_layer[i] > 1:
            experts = []
            for e in range(experts_per_layer[i]):
                q = f"{p}feed_forward.experts.{e}."
                up = torch.cat([w.get(q + "gate_proj.weight"), w.get(q + "up_proj.weight")])  # transformers fuses [gate | up]
                experts.append(Mlp(up=up, down=w.get(q + "down_proj.weight"), act=act, fused_gate=True))
            router = SoftmaxRouter(
                w.get(p + "feed_forward.router.weight"), int(config.num_experts_per_tok), softmax_after_topk=False
            )
            ffn = Moe(router=router, experts=experts)
        else:
            ffn = _gated_mlp(w, p + "feed_forward.", act)
        layers.append(
            Layer(
                [
                    Sublayer(Norm(w.get(p + "input_layernorm.weight"), eps), mixer),
                    Sublayer(Norm(w.get(p + "pre_ff_layernorm.weight"), eps), ffn),
                ]
            )
        )
    return Model(
        family="jamba",
        dtype=w.dtype,
        device=w.device,
        embed=w.get("model.embed_tokens.weight"),
        layers=layers,
        final_norm=Norm(w.get("model.final_layernorm.weight"), eps),
        lm_head=_head(config, w, "model.embed_tokens.weight"),
        conv_shape=_conv_shapes(layers),
    )


def _qwen_attention(config: Any, w: Weights, p: str) -> Attention:
    attention = _attention(config, w, p, rope=True)
    attention.gated = True
    attention.q_norm, attention.k_norm = w.get(p + "q_norm.weight"), w.get(p + "k_norm.weight")
    attention.norm_eps = float(config.rms_norm_eps)
    return attention


def _gdn(config: Any, w: Weights, p: str) -> GatedDeltaNet:
    conv = w.get(p + "conv1d.weight")
    return GatedDeltaNet(
        conv_weight=conv.reshape(conv.shape[0], conv.shape[-1]).contiguous(),
        A_log=w.get(p + "A_log").float(),
        dt_bias=w.get(p + "dt_bias"),
        norm_weight=w.get(p + "norm.weight"),
        out_proj=w.get(p + "out_proj.weight"),
        num_k_heads=int(config.linear_num_key_heads),
        num_v_heads=int(config.linear_num_value_heads),
        head_k_dim=int(config.linear_key_head_dim),
        head_v_dim=int(config.linear_value_head_dim),
        norm_eps=float(config.rms_norm_eps),
        in_qkvz=w.maybe(p + "in_proj_qkvz.weight"),
        in_ba=w.maybe(p + "in_proj_ba.weight"),
        in_qkv=w.maybe(p + "in_proj_qkv.weight"),
        in_z=w.maybe(p + "in_proj_z.weight"),
        in_b=w.maybe(p + "in_proj_b.weight"),
        in_a=w.maybe(p + "in_proj_a.weight"),
    )


def _qwen_moe(config: Any, w: Weights, p: str, act: Any, normalize: bool) -> Moe:
    experts = []
    for e in range(int(config.num_experts)):
        q = f"{p}experts.{e}."
        up = torch.cat([w.get(q + "gate_proj.weight"), w.get(q + "up_proj.weight")])  # transformers fuses [gate | up]
        experts.append(Mlp(up=up, down=w.get(q + "down_proj.weight"), act=act, fused_gate=True))
    router = SoftmaxRouter(
        w.get(p + "gate.weight"), int(config.num_experts_per_tok), softmax_after_topk=False, normalize_topk=normalize
    )
    return Moe(
        router=router,
        experts=experts,
        shared=_gated_mlp(w, p + "shared_expert.", act),
        shared_gate=w.get(p + "shared_expert_gate.weight"),
    )


def qwen(config: Any, w: Weights) -> Model:
    """Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text models; a multimodal wrapper's language model)."""
    family = str(config.model_type)
    base = "model.language_model." if w.has("model.language_model.embed_tokens.weight") else "model."
    eps = float(config.rms_norm_eps)
    act = activation(config.hidden_act)
    moe_every = family in ("qwen3_5_moe", "qwen3_5_moe_text")
    sparse_step = int(getattr(config, "decoder_sparse_step", None) or 1)
    mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
    layers = []
    for i, kind in enumerate(_layer_kind(k) for k in config.layer_types):
        p = f"{base}layers.{i}."
        mixer: Attention | GatedDeltaNet = (
            _gdn(config, w, p + "linear_attn.") if kind == "mamba" else _qwen_attention(config, w, p + "self_attn.")
        )
        ffn: Mlp | Moe
        if moe_every:
            ffn = _qwen_moe(config, w, p + "mlp.", act, True)
        elif family == "qwen3_next" and i not in mlp_only and int(config.num_experts) > 0 and (i + 1) % sparse_step == 0:
            ffn = _qwen_moe(config, w, p + "mlp.", act, bool(config.norm_topk_prob))
        else:
            ffn = _gated_mlp(w, p + "mlp.", act)
        layers.append(
            Layer(
                [
                    Sublayer(Norm(w.get(p + "input_layernorm.weight"), eps, offset=1.0), mixer),
                    Sublayer(Norm(w.get(p + "post_attention_layernorm.weight"), eps, offset=1.0), ffn),
                ]
            )
        )
    return Model(
        family=family,
        dtype=w.dtype,
        device=w.device,
        embed=w.get(base + "embed_tokens.weight"),
        layers=layers,
        final_norm=Norm(w.get(base + "norm.weight"), eps, offset=1.0),
        lm_head=_head(config, w, base + "embed_tokens.weight"),
        conv_shape=_conv_shapes(layers),
    )


BUILDERS: dict[str, Callable[[Any, Weights], Model]] = {
    "nemotron_h": nemotron_h,
    "bamba": bamba,
    "granitemoehybrid": granitemoehybrid,
    "falcon_h1": falcon_h1,
    "jamba": jamba,
    "qwen3_next": qwen,
    "qwen3_5": qwen,
    "qwen3_5_text": qwen,
    "qwen3_5_moe": qwen,
    "qwen3_5_moe_text": qwen,
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(BUILDERS)
# Families whose tiny checkpoints route tokens to experts (tests/unit/engine_batched).
MOE_FAMILIES: tuple[str, ...] = ("granitemoehybrid", "jamba", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def check_family(family: str) -> Callable[[Any, Weights], Model]:
    """The builder of `family`; UnsupportedFamily naming the engines that serve it otherwise."""
    builder = BUILDERS.get(family)
    if builder is None:
        served = "--engine hf" if family in ALL_HYBRID_FAMILIES else "no engine of this project"
        raise UnsupportedFamily(
            f"model family {family!r}: the paged engine implements {', '.join(SUPPORTED_FAMILIES)}; {family} is served by {served}"
        )
    return builder


def build_model(config: Any, weights: Weights) -> Model:
    return check_family(str(config.model_type))(config, weights)
