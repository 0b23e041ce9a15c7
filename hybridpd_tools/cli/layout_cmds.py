"""`hybrid-pd models` and `hybrid-pd plan`: the layout math as a command-line tool.

`plan` exits 0 when the verifier finds nothing, 1 when it finds violations (printed), 2 for
invalid input (one line on stderr). `plan --all` sweeps every preset over (P_TP, D_TP) in
{1, 2, 4, 8, 16}^2 and says which pairs are invalid and why.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from shared.layout.models import load_model
from shared.layout.page import DEFAULT_ALIGNMENT, EngineLayout, build_engine_layout
from shared.layout.plan import TransferPlan, build_plan
from shared.layout.plan_json import plan_to_json
from shared.layout.presets import PRESETS
from shared.layout.shapes import valid_tp
from shared.layout.spec import DTYPES, GDNDims, LayoutError, Mamba1Dims, Mamba2Dims, ModelSpec
from shared.layout.verify import verify_plan

TP_SIZES = (1, 2, 4, 8, 16)
EXIT_OK, EXIT_VIOLATIONS, EXIT_INVALID = 0, 1, 2


def _env(flag: str, convert: Callable[[str], Any] = str) -> Any:
    """Default of `--flag` from HYBRID_PD_<FLAG> (None when unset)."""
    raw = os.environ.get("HYBRID_PD_" + flag.upper().replace("-", "_"))
    if raw is None or raw == "":
        return None
    try:
        return convert(raw)
    except ValueError:
        raise SystemExit(f"hybrid-pd: HYBRID_PD_{flag.upper().replace('-', '_')}={raw!r} is not valid") from None


def _env_flag(flag: str) -> bool:
    return bool(_env(flag, lambda s: s.lower() in ("1", "true", "yes", "on")))


def register(subparsers: Any) -> None:
    """Add `models` and `plan` to the `hybrid-pd` command."""
    models = subparsers.add_parser("models", help="list the model presets and their valid TP sizes")
    models.add_argument("--json", action="store_true", default=_env_flag("json"), help="print JSON instead of a table")
    models.set_defaults(func=run_models)

    plan = subparsers.add_parser(
        "plan",
        help="build and verify the transfer plan for a prefill/decode TP pair",
        description="Which bytes each decode rank reads from which prefill rank, verified on byte intervals.",
    )
    plan.add_argument("--model", default=_env("model"), help="preset name, config.json path, or a directory with config.json")
    plan.add_argument("--prefill-tp", type=int, default=_env("prefill-tp", int), help="prefill tensor-parallel size")
    plan.add_argument("--decode-tp", type=int, default=_env("decode-tp", int), help="decode tensor-parallel size")
    for name in ("kv", "conv", "ssm"):
        plan.add_argument(
            f"--{name}-dtype",
            choices=DTYPES,
            default=_env(f"{name}-dtype"),
            help=f"{name.upper()} cache dtype (default: the model's, as vLLM picks it)",
        )
    plan.add_argument(
        "--block-size",
        type=int,
        default=_env("block-size", int),
        help="logical block size in tokens for both sides; raised to the hybrid minimum when smaller",
    )
    plan.add_argument(
        "--prefill-kernel-block-size",
        type=int,
        default=_env("prefill-kernel-block-size", int),
        help="attention kernel block size on prefill (default: the logical block size)",
    )
    plan.add_argument(
        "--decode-kernel-block-size",
        type=int,
        default=_env("decode-kernel-block-size", int),
        help="attention kernel block size on decode (default: the logical block size)",
    )
    plan.add_argument(
        "--alignment",
        type=int,
        default=_env("alignment", int) or DEFAULT_ALIGNMENT,
        help=f"token alignment of the computed block size (default {DEFAULT_ALIGNMENT})",
    )
    plan.add_argument(
        "--tokens",
        type=int,
        default=_env("tokens", int) or 1000,
        help="prompt length used for the per-request byte counts of the table (default 1000)",
    )
    plan.add_argument(
        "--json",
        action="store_true",
        default=_env_flag("json"),
        help="print the plan as JSON (schema hybrid-pd.plan/v1)",
    )
    plan.add_argument(
        "--all",
        "--sweep",
        dest="all",
        action="store_true",
        default=_env_flag("all"),
        help="verify every preset at every (prefill, decode) TP in {1,2,4,8,16}^2 and list the invalid pairs",
    )
    plan.set_defaults(func=run_plan)


# --- models ---------------------------------------------------------------------------------


def _ssm_dims(spec: ModelSpec) -> str:
    s = spec.ssm
    if isinstance(s, Mamba2Dims):
        return f"H{s.num_heads} P{s.head_dim} G{s.n_groups} N{s.d_state}"
    if isinstance(s, GDNDims):
        return f"Hk{s.num_k_heads} Hv{s.num_v_heads} Dk{s.head_k_dim} Dv{s.head_v_dim}"
    assert isinstance(s, Mamba1Dims)
    return f"D{s.d_inner} N{s.d_state}"


def _layers(spec: ModelSpec) -> str:
    counts = {k: spec.layer_kinds.count(k) for k in ("attention", "ssm", "parallel")}
    parts = [f"{counts['attention']} attn", f"{counts['ssm']} ssm"] if not counts["parallel"] else []
    if counts["parallel"]:
        parts.append(f"{counts['parallel']} attn+ssm")
    return f"{spec.num_layers} = " + " + ".join(parts) + (" + mlp" if "mlp" in spec.layer_kinds else "")


def _model_row(name: str, spec: ModelSpec) -> dict[str, Any]:
    a = spec.attention
    return {
        "name": name,
        "family": spec.family,
        "model_type": spec.model_type,
        "layers": _layers(spec),
        "attention": f"{a.num_heads}q/{a.num_kv_heads}kv x{a.head_dim}",
        "ssm": _ssm_dims(spec),
        "dtypes": f"{spec.kv_dtype}/{spec.conv_dtype}/{spec.ssm_dtype}",
        "valid_tp": [tp for tp in TP_SIZES if valid_tp(spec, tp)],
    }


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip(), file=out)


def run_models(args: argparse.Namespace) -> int:
    rows = [_model_row(name, spec) for name, spec in PRESETS.items()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    header = ["MODEL", "FAMILY", "TYPE", "LAYERS", "ATTENTION", "SSM", "KV/CONV/SSM", "VALID TP"]
    body = [[str(r[k]) for k in ("name", "family", "model_type", "layers", "attention", "ssm", "dtypes")] for r in rows]
    for line, r in zip(body, rows):
        line.append(",".join(str(t) for t in r["valid_tp"]))
    _table([header, *body], sys.stdout)
    return EXIT_OK


# --- plan -----------------------------------------------------------------------------------


def _fail(reason: str) -> int:
    print(f"hybrid-pd plan: error: {reason}", file=sys.stderr)
    return EXIT_INVALID


def _layouts(spec: ModelSpec, args: argparse.Namespace, p_tp: int, d_tp: int) -> tuple[EngineLayout, EngineLayout]:
    def side(tp: int, kernel: int | None) -> EngineLayout:
        return build_engine_layout(spec, tp, block_size=args.block_size, kernel_block_size=kernel, alignment=args.alignment)

    return side(p_tp, args.prefill_kernel_block_size), side(d_tp, args.decode_kernel_block_size)


def _load(args: argparse.Namespace, model: str) -> ModelSpec:
    return load_model(model, kv_dtype=args.kv_dtype, conv_dtype=args.conv_dtype, ssm_dtype=args.ssm_dtype)


def run_plan(args: argparse.Namespace) -> int:
    if args.all:
        return _sweep(args)
    given = (("--model", args.model), ("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp))
    missing = [flag for flag, value in given if value is None]
    if missing:
        return _fail(f"missing {', '.join(missing)} (or use --all)")
    try:
        spec = _load(args, args.model)
        prefill, decode = _layouts(spec, args, args.prefill_tp, args.decode_tp)
        plan = build_plan(prefill, decode)
    except LayoutError as e:
        return _fail(str(e))
    violations = verify_plan(plan)
    if args.json:
        print(json.dumps(plan_to_json(plan, violations), indent=2))
    else:
        print_plan(plan, violations, tokens=args.tokens, out=sys.stdout)
    return EXIT_VIOLATIONS if violations else EXIT_OK


def _side_rows(plan: TransferPlan) -> list[list[str]]:
    p, d = plan.prefill, plan.decode

    def kv(lay: EngineLayout) -> str:
        return f"{lay.shapes.kv_heads_per_rank}" + (" (replicated)" if lay.shapes.kv_replicated else "")

    def block(lay: EngineLayout) -> str:
        if lay.block_size_raised:
            return f"{lay.block_size} (requested {lay.requested_block_size}, raised to the minimum)"
        return str(lay.block_size)

    def sections(lay: EngineLayout) -> str:
        s = lay.shapes
        text = " ".join(f"{n}:{dim}" for n, dim in zip(s.section_names, s.section_dims))
        shared = [(n, r) for n, r in zip(s.section_names, s.section_replicas) if r > 1]
        if shared:
            text += f" ({', '.join(n for n, _ in shared)} replicated on {shared[0][1]} ranks)"
        return text

    rows: list[tuple[str, Callable[[EngineLayout], str]]] = [
        ("TP", lambda lay: str(lay.tp)),
        ("KV heads per rank", kv),
        ("block size (tokens)", block),
        ("kernel block size", lambda lay: str(lay.kernel_block_size)),
        ("physical per logical", lambda lay: str(lay.physical_per_logical)),
        ("page bytes", lambda lay: f"{lay.page_bytes} (Mamba {lay.mamba_bytes} + padding {lay.padding_bytes})"),
        ("FA bytes per token", lambda lay: str(lay.shapes.fa_bytes_per_token)),
        ("conv state", lambda lay: f"({lay.shapes.conv_dim}, {lay.shapes.conv_rows}) {sections(lay)}"),
        ("conv bytes", lambda lay: str(lay.shapes.conv_bytes)),
        ("SSM state", lambda lay: f"{lay.shapes.ssm_shape}"),
        ("SSM bytes", lambda lay: str(lay.shapes.ssm_bytes)),
    ]
    return [["", "PREFILL", "DECODE"]] + [[name, f(p), f(d)] for name, f in rows]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n} B"


def print_plan(plan: TransferPlan, violations: list[str], *, tokens: int, out: TextIO) -> None:
    spec, dec = plan.decode.spec, plan.decode
    print(
        f"{spec.name} ({spec.family}): prefill TP {plan.prefill.tp} -> decode TP {dec.tp}, tp_ratio {plan.tp_ratio:+d}",
        file=out,
    )
    groups = ", ".join(f"{g.kind}{list(g.layers)}" for g in dec.groups)
    print(f"regions {dec.num_regions}; groups {groups}", file=out)
    print(f"FA unit {plan.fa_unit_tokens} tokens (gcd of the kernel block sizes)\n", file=out)
    _table(_side_rows(plan), out)
    n_fa, n_ssm = len(spec.attention_layers), len(spec.ssm_layers)
    units = -(-tokens // plan.fa_unit_tokens)
    names = dec.shapes.section_names
    for rank in plan.ranks:
        fa_src, mamba_src = list(rank.fa_sources), list(rank.mamba_sources)
        print(f"\ndecode rank {rank.decode_rank}: FA sources {fa_src}, Mamba sources {mamba_src}", file=out)
        rows = [["from", "what", "remote offset", "local offset", "bytes"]]
        fa_total = mamba_total = 0
        for read in rank.reads:
            src = f"P{read.prefill_rank}"
            if read.fa is not None:
                fa = read.fa
                rows.append([src, "FA K (same for V)", str(fa.remote_offset), str(fa.local_offset), str(fa.size)])
                fa_total += 2 * read.fa.size * units * n_fa
            for name, c in zip(names, read.conv):
                if c is not None:
                    rows.append([src, f"conv {name}", str(c.remote_offset), str(c.local_offset), str(c.size)])
            if read.ssm is not None:
                rows.append([src, "SSM", str(read.ssm.remote_offset), str(read.ssm.local_offset), str(read.ssm.size)])
            mamba_total += sum(m.size for m in read.mamba_reads) * n_ssm
        _table(rows, out)
        fa_part, mamba_part = f"FA {_mib(fa_total)} ({n_fa} layers)", f"Mamba {_mib(mamba_total)} ({n_ssm} layers)"
        print(f"per request of {tokens} tokens: {fa_part}, {mamba_part}", file=out)
    if violations:
        print(f"\nVIOLATIONS ({len(violations)}):", file=out)
        for v in violations:
            print(f"  {v}", file=out)
    else:
        print("\nverified: every byte each decode rank holds is read exactly once, from the right section", file=out)


def _sweep(args: argparse.Namespace) -> int:
    rows = [["MODEL", "VERIFIED", "INVALID", "VIOLATIONS"]]
    invalid: dict[str, list[str]] = {}
    violated: list[str] = []
    for name in PRESETS:
        try:
            spec = _load(args, name)
        except LayoutError as e:
            return _fail(str(e))
        counts = [0, 0, 0]
        for p_tp, d_tp in itertools.product(TP_SIZES, repeat=2):
            try:
                plan = build_plan(*_layouts(spec, args, p_tp, d_tp))
            except LayoutError as e:
                counts[1] += 1
                invalid.setdefault(str(e), []).append(f"{p_tp}->{d_tp}")
                continue
            violations = verify_plan(plan)
            counts[2 if violations else 0] += 1
            violated += [f"{name} {p_tp}->{d_tp}: {v}" for v in violations]
        total = len(TP_SIZES) ** 2
        rows.append([name, f"{counts[0]}/{total}", str(counts[1]), str(counts[2])])
    _table(rows, sys.stdout)
    if invalid:
        print("\ninvalid (P_TP->D_TP):")
        for reason, pairs in invalid.items():
            print(f"  {' '.join(pairs)}  {reason}")
    if violated:
        print(f"\nVIOLATIONS ({len(violated)}):")
        for v in violated:
            print(f"  {v}")
    return EXIT_VIOLATIONS if violated else EXIT_OK
