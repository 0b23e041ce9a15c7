"""The reference hybrid model: embedding, a stack of pre-norm layers, final norm, LM head.

`step` is the canonical math: one token through every layer, reading and writing state through
a `StateStore`. `prefill` literally calls `step` per token, so splitting a prompt between two
processes at any boundary gives bit-identical state and tokens (hybrid-models.md 3.3).
Each request is computed on its own: no batching across requests, fp32 throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.compute_threads import pin_intra_op_threads
from shared.engine.reference.attention import Attention, rope_table
from shared.engine.reference.gdn import GatedDeltaNet
from shared.engine.reference.mamba1 import Mamba1
from shared.engine.reference.mamba2 import Mamba2
from shared.engine.reference.numerics import canonical, configure_determinism, rms_norm
from shared.engine.reference.state_store import DenseStateStore, StateStore
from shared.engine.reference.weights import generate_weights, layer_prefix, model_fingerprint
from shared.layout.spec import GDNDims, Mamba1Dims, Mamba2Dims, ModelSpec

SSMMixer = Mamba2 | GatedDeltaNet | Mamba1
DEFAULT_MAX_POSITIONS = 8192


def _sub(weights: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {name[len(prefix) :]: t for name, t in weights.items() if name.startswith(prefix)}


def build_ssm_mixer(spec: ModelSpec, weights: dict[str, Tensor]) -> SSMMixer:
    d = spec.ssm
    if isinstance(d, Mamba2Dims):
        if d.num_heads % d.n_groups:
            raise ValueError(f"{spec.name}: Mamba2 num_heads {d.num_heads} not divisible by n_groups {d.n_groups}")
        return Mamba2(d, weights)
    if isinstance(d, GDNDims):
        if d.num_v_heads % d.num_k_heads:
            raise ValueError(f"{spec.name}: GDN num_v_heads {d.num_v_heads} not divisible by num_k_heads")
        return GatedDeltaNet(d, weights)
    assert isinstance(d, Mamba1Dims)
    return Mamba1(d, weights)


@dataclass
class DecoderLayer:
    index: int
    kind: str
    norm_mixer: Tensor | None
    norm_mlp: Tensor
    attn: Attention | None
    ssm: SSMMixer | None
    w_gate_up: Tensor
    w_down: Tensor

    def mlp(self, h: Tensor) -> Tensor:
        """SwiGLU: down(silu(gate) * up)."""
        gate, up = F.linear(h, self.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)


def greedy(logits: Tensor) -> int:
    """Greedy sampling; ties go to the lowest token id."""
    return int(torch.argmax(logits))


class ReferenceModel:
    """A tiny hybrid model built from a `ModelSpec` with seeded weights (`seed`) on `device`."""

    def __init__(
        self,
        spec: ModelSpec,
        seed: int = 0,
        device: torch.device | str = "cpu",
        max_positions: int = DEFAULT_MAX_POSITIONS,
    ) -> None:
        configure_determinism()
        dtypes = {"kv": spec.kv_dtype, "conv": spec.conv_dtype, "ssm": spec.ssm_dtype}
        if any(dt != "fp32" for dt in dtypes.values()):
            raise ValueError(f"{spec.name}: the reference engine computes and stores fp32 state; spec declares {dtypes}")
        a = spec.attention
        if spec.attention_layers and a.num_heads % a.num_kv_heads:
            raise ValueError(f"{spec.name}: num_heads {a.num_heads} not divisible by num_kv_heads {a.num_kv_heads}")
        self.spec, self.seed, self.device = spec, seed, torch.device(device)
        self.max_positions = max_positions
        self.fingerprint = model_fingerprint(spec, seed)
        self.weights = {n: t.to(self.device) for n, t in generate_weights(spec, seed).items()}
        w = self.weights
        self.embed, self.final_norm, self.lm_head = w["embed"], w["final_norm"], w["lm_head"]
        self.rope = rope_table(a.head_dim, max_positions, self.device) if a.rope else None
        self.layers = [self._build_layer(i, kind) for i, kind in enumerate(spec.layer_kinds)]

    def _build_layer(self, index: int, kind: str) -> DecoderLayer:
        w = _sub(self.weights, layer_prefix(index))
        attn = Attention(self.spec.attention, _sub(w, "attn.")) if kind in ("attention", "parallel") else None
        ssm = build_ssm_mixer(self.spec, _sub(w, "ssm.")) if kind in ("ssm", "parallel") else None
        return DecoderLayer(index, kind, w.get("norm_mixer"), w["norm_mlp"], attn, ssm, w["mlp.w_gate_up"], w["mlp.w_down"])

    def new_store(self) -> DenseStateStore:
        """A dense store for a new request (zero SSM state, no K/V)."""
        return DenseStateStore(self.spec, self.device)

    def step(self, token: int, pos: int, store: StateStore, on_layer: Callable[[int], None] | None = None) -> Tensor:
        """Run token `token` at position `pos` through every layer; return its logits `[vocab]`.

        Reads the state after positions `0..pos-1` from `store` and leaves the state after `pos`.
        `on_layer(i)` is called after layer i (each layer writes only its own state, so layer
        i's state after `pos` is then complete in `store`).
        Runs on one intra-op thread on whichever thread calls it (see compute_threads).
        """
        pin_intra_op_threads(1)
        if not 0 <= token < self.spec.vocab_size:
            raise ValueError(f"token id {token} outside the vocabulary [0, {self.spec.vocab_size})")
        if not 0 <= pos < self.max_positions:
            raise ValueError(f"position {pos} outside [0, {self.max_positions}) (raise max_positions)")
        rope = (self.rope[0][pos], self.rope[1][pos]) if self.rope is not None else None
        x = self.embed[token]
        for layer in self.layers:
            if layer.norm_mixer is not None:
                h = rms_norm(x, layer.norm_mixer)
                mixed: Tensor | None = None
                if layer.attn is not None:
                    q, k, v = layer.attn.project(h, rope)
                    store.write_kv(layer.index, pos, k, v)
                    keys, values = store.read_kv(layer.index, pos + 1)
                    mixed = layer.attn.attend(q, canonical(keys), canonical(values))
                if layer.ssm is not None:
                    conv, state = store.read_ssm(layer.index)
                    out, conv, state = layer.ssm.step(h, conv, canonical(state))
                    store.write_ssm(layer.index, conv, state)
                    mixed = out if mixed is None else mixed + out
                assert mixed is not None
                x = x + mixed
            x = x + layer.mlp(rms_norm(x, layer.norm_mlp))
            if on_layer is not None:
                on_layer(layer.index)
        return torch.mv(self.lm_head, rms_norm(x, self.final_norm))

    def prefill(
        self,
        tokens: Sequence[int],
        store: StateStore,
        start_pos: int = 0,
        on_layer: Callable[[int], None] | None = None,
    ) -> Tensor | None:
        """Step through `tokens` at positions `start_pos...`; logits of the last one (None if empty).
        `on_layer(i)`: called in the last token's step once layer i's state is final (`step`)."""
        logits = None
        last = len(tokens) - 1
        for offset, token in enumerate(tokens):
            logits = self.step(token, start_pos + offset, store, on_layer if offset == last else None)
        return logits

    def continue_greedy(self, logits: Tensor, next_pos: int, store: StateStore, max_tokens: int) -> list[int]:
        """Sample greedily from `logits`, then keep stepping: `max_tokens` new token ids.
        `next_pos` is the position the first sampled token will occupy."""
        out: list[int] = []
        for i in range(max_tokens):
            token = greedy(logits)
            out.append(token)
            if i + 1 < max_tokens:
                logits = self.step(token, next_pos + i, store)
        return out

    def decode(self, token: int, pos: int, store: StateStore, max_tokens: int) -> list[int]:
        """Compute `token` at `pos` from the state in `store`, then generate `max_tokens` ids."""
        if max_tokens <= 0:
            return []
        return self.continue_greedy(self.step(token, pos, store), pos + 1, store, max_tokens)

    def generate(self, prompt: Sequence[int], max_tokens: int, store: StateStore | None = None) -> list[int]:
        """Greedy generation in one process: the plain (colocated) run."""
        if not prompt:
            raise ValueError("empty prompt: at least one token is needed")
        store = store if store is not None else self.new_store()
        if max_tokens <= 0:
            return []
        logits = self.prefill(prompt, store)
        assert logits is not None
        return self.continue_greedy(logits, len(prompt), store, max_tokens)
