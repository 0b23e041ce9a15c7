"""Tiny seeded random checkpoints of every hybrid family transformers has, built offline.

`build_checkpoint(family, directory)` writes what a real Hugging Face checkpoint directory
holds: config.json, model.safetensors, a real tokenizer (tokenizer.json + tokenizer_config.json,
a small BPE trained here on a few sentences, and its Jinja chat template, which transformers
saves as chat_template.jinja) and generation_config.json with the EOS ids.
Nothing is downloaded. Dims are small but keep every TP size in {1, 2, 4} valid (KV heads
replicated at TP 4), the weights are larger than transformers' default init and the SSM decays
slow, so that tokens depend visibly on the state (negative controls can then fail).

Used by the tests (once per session) and by demos. `size="small"` (nemotron_h only) makes a
checkpoint about 60 times heavier per token, for benchmarks: with the tiny one a 2k-token prefill
costs so little that the few milliseconds of two extra network hops dominate any ratio.
`size="bench64"` (nemotron_h only) is the checkpoint measured against vLLM
(scripts/bench-vs-vllm.sh): attention heads of 64, a size vLLM's CPU attention runs (16 is not).

`VARIANTS` are tiny checkpoints of a family with one config feature on top (Nemotron-H's routed
experts, a scaled RoPE): `build_checkpoint(family, ..., variant=name)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from shared.cache_root import cache_root
from shared.engine.paged.support import ALL_HYBRID_FAMILIES
from shared.logs.third_party import transformers_module

FAMILIES: tuple[str, ...] = ALL_HYBRID_FAMILIES  # one list: the paged engine reads it without torch

SIZES: tuple[str, ...] = ("tiny", "small", "bench64")
SMALL_FAMILIES: tuple[str, ...] = ("nemotron_h",)
VOCAB_SIZE = 320  # 4 special tokens, the 256 bytes (any text encodes), merges
EOS_TOKEN = "</s>"
BOS_TOKEN = "<s>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<unk>", "<pad>")
TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog.",
    "Hybrid models keep attention keys and values next to a fixed size state.",
    "Prefill computes the prompt, decode continues the generation token by token.",
    "Mamba layers keep a convolution window and a recurrent state per head.",
    "Hello world, hello again, and hello once more.",
)
# ChatML-like, so it renders differently from the services' byte template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Part of the cache key: bump it whenever what build_checkpoint writes changes, so that
# checkpoints cached by an earlier version are rebuilt (2: the chat template).
CHECKPOINT_FORMAT = 2
_ATTN: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    initializer_range=0.2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _mamba2_hf(n_groups: int) -> dict[str, Any]:
    return dict(
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=n_groups,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
    )


def _gdn() -> dict[str, Any]:
    return dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )


def _moe() -> dict[str, Any]:
    return dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _nemotron_moe(latent: int | None) -> dict[str, Any]:
    """Routed experts in grouped top-k (4 groups of 2, the best 2 groups, 3 experts of them)."""
    return dict(
        layers_block_type=["mamba", "attention", "moe", "mamba", "moe"],
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_latent_size=latent,
        norm_topk_prob=latent is None,
        routed_scaling_factor=2.5,
    )


def _rope(rope_type: str, partial: float, **params: Any) -> dict[str, Any]:
    return dict(rope_parameters=dict(rope_type=rope_type, rope_theta=10000.0, partial_rotary_factor=partial, **params))


# name -> (family, config fields set on top of the family's tiny config). The RoPE ones scale
# positions well inside the prompts the tests run, so a scaling left out changes the logits.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "moe": ("nemotron_h", _nemotron_moe(None)),
    "moe-latent": ("nemotron_h", _nemotron_moe(48)),
    "rope-linear": ("bamba", _rope("linear", 0.5, factor=4.0)),
    "rope-llama3": (
        "bamba",
        _rope("llama3", 0.5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    "rope-yarn": ("qwen3_5_text", _rope("yarn", 0.25, factor=4.0, original_max_position_embeddings=128)),
    "rope-dynamic": ("bamba", _rope("dynamic", 0.5, factor=4.0)),
    "rope-longrope": (
        "qwen3_next",
        _rope(
            "longrope", 0.25, factor=4.0, short_factor=[1.0, 1.5], long_factor=[4.0, 8.0], original_max_position_embeddings=128
        ),
    ),
}


def variant_family(variant: str) -> str:
    """The family a variant is a checkpoint of (ValueError naming the variants otherwise)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return VARIANTS[variant][0]


def _transformers() -> Any:
    """transformers, untyped (its signatures do not type-check under --strict); its progress bars
    ("Writing model shards") off and its logs through ours (shared/logs/third_party.py)."""
    return transformers_module()


def _small_config(family: str) -> Any:
    """Benchmark-sized: 8 layers of width 512, attention heads of 64, Mamba2 heads of 64 with a
    state of 64 (about 10M parameters): still random weights, still made offline."""
    if family not in SMALL_FAMILIES:
        raise ValueError(f"size 'small' is made for {', '.join(SMALL_FAMILIES)} only, not {family!r}")
    return _transformers().NemotronHConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1024,
        initializer_range=0.02,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        layers_block_type=["mamba", "attention", "mlp", "mamba"] * 2,
        mamba_num_heads=16,
        mamba_head_dim=64,
        n_groups=1,
        ssm_state_size=64,
        conv_kernel=4,
        chunk_size=128,
    )


def _bench64_config(family: str) -> Any:
    """The checkpoint both vLLM and our services run in `scripts/bench-vs-vllm.sh`: hidden 256,
    6 layers (mamba, attention, mamba, mlp, mamba, attention), 4 attention heads and 2 KV heads of
    64, 8 Mamba2 heads of 32 in 2 groups with a state of 32, the tests' 320-token vocabulary."""
    if family not in SMALL_FAMILIES:
        raise ValueError(f"size 'bench64' is made for {', '.join(SMALL_FAMILIES)} only, not {family!r}")
    return _transformers().NemotronHConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        initializer_range=0.02,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=3,
        layers_block_type=["mamba", "attention", "mamba", "mlp", "mamba", "attention"],
        mamba_num_heads=8,
        mamba_head_dim=32,
        n_groups=2,
        ssm_state_size=32,
        conv_kernel=4,
        chunk_size=128,
        expand=1,
    )


def _config(family: str, size: str = "tiny", variant: str | None = None) -> Any:
    if variant is not None:
        if variant_family(variant) != family or size != "tiny":
            raise ValueError(f"variant {variant!r} is a tiny {VARIANTS[variant][0]} checkpoint, not a {size} {family} one")
        base = _config(family)
        return type(base)(**(base.to_dict() | VARIANTS[variant][1]))
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if size == "small":
        return _small_config(family)
    if size == "bench64":
        return _bench64_config(family)
    tf = _transformers()
    ids: dict[str, Any] = dict(bos_token_id=0, eos_token_id=1, pad_token_id=3)
    builders: dict[str, Callable[[], Any]] = {
        "nemotron_h": lambda: tf.NemotronHConfig(
            **_COMMON,
            **_ATTN,
            **ids,
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=1,
            ssm_state_size=16,
            conv_kernel=4,
            chunk_size=8,
            expand=1,
        ),
        "bamba": lambda: tf.BambaConfig(
            **_COMMON, **_ATTN, **ids, num_hidden_layers=4, attn_layer_indices=[1, 3], **_mamba2_hf(1)
        ),
        "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(
            **_COMMON,
            **_ATTN,
            **ids,
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "attention"],
            position_embedding_type="rope",
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=64,
            **_mamba2_hf(4),
        ),
        "falcon_h1": lambda: tf.FalconH1Config(**_COMMON, **_ATTN, **ids, num_hidden_layers=3, **_mamba2_hf(4), mamba_d_ssm=128),
        "jamba": lambda: tf.JambaConfig(
            **_COMMON,
            **_ATTN,
            **ids,
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            use_mamba_kernels=False,
        ),
        "qwen3_next": lambda: tf.Qwen3NextConfig(**_COMMON, **_ATTN, **ids, num_hidden_layers=4, **_gdn(), **_moe()),
        "qwen3_5_text": lambda: tf.Qwen3_5TextConfig(**_COMMON, **_ATTN, **ids, num_hidden_layers=4, **_gdn()),
        "qwen3_5_moe_text": lambda: tf.Qwen3_5MoeTextConfig(
            **{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
            **_ATTN,
            **ids,
            num_hidden_layers=4,
            **_gdn(),
            **_moe(),
        ),
    }
    if family in ("qwen3_5", "qwen3_5_moe"):
        text = _config(family + "_text").to_dict()
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=64,
            patch_size=4,
            temporal_patch_size=1,
            spatial_merge_size=1,
        )
        cls = tf.Qwen3_5Config if family == "qwen3_5" else tf.Qwen3_5MoeConfig
        return cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    return builders[family]()


def _long_memory(model: Any) -> None:
    """Slow decays (A = -exp(A_log) in [-0.2, -0.02]) instead of transformers' init (down to
    -16, which forgets within a token or two): the transferred SSM state then shapes the tokens
    for many steps, so damaging it visibly changes them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                flat = torch.linspace(0.02, 0.2, param.numel(), dtype=torch.float32)
                param.copy_(flat.log().reshape(param.shape))


def _correction_bias(model: Any) -> None:
    """Router correction biases of the size of the sigmoid scores they shift (transformers
    initialises them to zero), so that routing without them picks other experts."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                n = buffer.numel()
                spread = ((torch.arange(n) * 5) % n).to(torch.float32) / max(n - 1, 1)
                buffer.copy_((0.8 * spread - 0.4).reshape(buffer.shape))


def build_tokenizer(directory: str) -> None:
    """A small byte-level BPE (every byte is a token, so any text encodes) trained on a few
    sentences, with `CHAT_TEMPLATE`, saved so AutoTokenizer loads it offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    fast = _transformers().PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def build_checkpoint(family: str, directory: str, *, seed: int = 0, size: str = "tiny", variant: str | None = None) -> str:
    """Write a random checkpoint of `family` and `size` (or of a tiny `variant` of it) into
    `directory` (created); returns it."""
    tf = _transformers()
    config = _config(family, size, variant)
    os.makedirs(directory, exist_ok=True)
    torch.manual_seed(seed)
    # The multimodal wrappers are saved as published (model_type qwen3_5 / qwen3_5_moe, language
    # model under text_config, vision tower included): the engine must load the text part of them.
    auto = tf.AutoModelForImageTextToText if family in ("qwen3_5", "qwen3_5_moe") else tf.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    _long_memory(model)
    _correction_bias(model)
    model.save_pretrained(directory)
    build_tokenizer(directory)
    tf.GenerationConfig(bos_token_id=0, eos_token_id=[1], pad_token_id=3).save_pretrained(directory)
    return directory


def cached_checkpoint(
    family: str, *, seed: int = 0, root: str | None = None, size: str = "tiny", variant: str | None = None
) -> str:
    """The checkpoint of `family` and `size` (or `variant`), made on first use and kept (keyed by `CHECKPOINT_FORMAT`
    and by the transformers version, whose save format may change). Built aside and renamed into
    place, so a run that is interrupted never leaves a half-written checkpoint behind."""
    import tempfile

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    _config(family, size, variant)  # refuses a size the family is not made in, before anything is written
    base = os.path.join(root or cache_root(), "tiny-checkpoints")
    sized = ("" if size == "tiny" else f"-{size}") + ("" if variant is None else f"-{variant}")
    directory = os.path.join(base, f"{family}{sized}-seed{seed}-v{CHECKPOINT_FORMAT}-transformers{_transformers().__version__}")
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    os.makedirs(base, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{family}-", dir=base)
    build_checkpoint(family, staging, seed=seed, size=size, variant=variant)
    try:
        os.rename(staging, directory)
    except OSError:  # another run put it there first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return directory
