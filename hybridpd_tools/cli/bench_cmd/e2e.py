"""`hybrid-pd bench e2e`: its workloads (concurrency, long-prompt, multi-turn, repeat), each run
from the flags it takes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybridpd_tools.cli.bench_cmd.running import command_line, finish, run_async

if TYPE_CHECKING:
    from hybridpd_tools.bench.setups import SetupConfig

E2E_FLAGS = (
    "workload", "model", "engine", "concurrency", "prompt-tokens", "max-tokens", "requests-per-level", "warmup",
    "interleave", "prefill-tp", "decode-tp", "boundary", "crossover-model", "prefill-threads", "decode-threads",
)  # fmt: skip


LONG_PROMPT_FLAGS = (
    "workload", "model", "engine", "prompt-lengths", "requests-per-length", "max-tokens", "warmup", "prefill-tp", "decode-tp",
    "prefill-chunk-tokens", "manifest-part-tokens", "layer-parts", "boundary", "prefill-threads", "decode-threads",
)  # fmt: skip


MULTI_TURN_FLAGS = (
    "workload", "model", "engine", "turns", "conversations", "first-turn-tokens", "turn-tokens", "max-tokens", "warmup",
    "prefill-tp", "decode-tp", "prefix-cache-blocks", "prefill-chunk-tokens", "manifest-part-tokens", "prefill-threads",
    "decode-threads",
)  # fmt: skip


REPEAT_FLAGS = (
    "workload", "model", "engine", "prompts", "repeats", "prompt-tokens", "max-tokens", "warmup", "prefill-tp", "decode-tp",
    "prefill-chunk-tokens", "manifest-part-tokens", "boundary", "prefill-threads", "decode-threads",
)  # fmt: skip


WORKLOADS = ("concurrency", "long-prompt", "multi-turn", "repeat")


def _engine_and_model(args: argparse.Namespace) -> None:
    """Fill in the workload's engine (concurrency: reference; the long ones: hf, whose prefill of
    a 32k prompt takes seconds, not minutes) and model (reference: tiny-mamba2; hf: the tiny
    checkpoint of --hf-family and --hf-size, made on first use)."""
    if args.engine is None:
        args.engine = "reference" if args.workload in ("concurrency", "repeat") else "hf"
    if args.model is None:
        if args.engine in ("hf", "paged"):
            from shared.engine.hf.tiny_checkpoints import cached_checkpoint

            args.model = cached_checkpoint(args.hf_family, size=args.hf_size)
        else:
            args.model = "tiny-mamba2"


def _setup_config(args: argparse.Namespace, flags: Sequence[str]) -> SetupConfig:
    """What the workload's setups share, from the flags it takes (`flags`): a flag the workload
    does not take keeps the default."""
    from hybridpd_tools.bench.setups import SetupConfig

    return SetupConfig(
        model=args.model,
        engine=args.engine,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_chunk_tokens=args.prefill_chunk_tokens if "prefill-chunk-tokens" in flags else 0,
        manifest_part_tokens=args.manifest_part_tokens if "manifest-part-tokens" in flags else 0,
        layer_parts=args.layer_parts if "layer-parts" in flags else 0,
        boundary=(args.boundary or "") if "boundary" in flags else "",
        # None (not given): 0, the flag is not passed and the service's default applies.
        prefill_threads=(args.prefill_threads or 0) if "prefill-threads" in flags else 0,
        decode_threads=(args.decode_threads or 0) if "decode-threads" in flags else 0,
    )


def run(args: argparse.Namespace) -> int:
    _engine_and_model(args)
    if args.workload == "long-prompt":
        return _long_prompt(args)
    if args.workload == "multi-turn":
        return _multi_turn(args)
    if args.workload == "repeat":
        return _repeat(args)
    from hybridpd_tools.bench.e2e import E2EConfig, e2e_charts, format_e2e, run_e2e
    from hybridpd_tools.bench.plotting import sibling

    cfg = E2EConfig(
        setup=_setup_config(args, E2E_FLAGS),
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        requests_per_level=args.requests_per_level,
        warmup=args.warmup,
        interleave=args.interleave,
        crossover_model=args.crossover_model or "",
    )
    result = run_async(run_e2e(cfg, command=command_line("e2e", args, E2E_FLAGS), show_progress=not args.no_progress))

    def chart() -> list[tuple[str, Any]]:
        return [(str(sibling(args.plot, tag)), figure) for tag, figure in e2e_charts(result)]

    return finish(args, result, format_e2e(result), chart)


def _no_chart(args: argparse.Namespace) -> None:
    if args.plot:
        print(f"--plot: the {args.workload} workload has no chart (its figures are in the table and --json)", file=sys.stderr)


def _long_prompt(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.long_prompt import LongPromptConfig, format_long_prompt, run_long_prompt

    cfg = LongPromptConfig(
        setup=_setup_config(args, LONG_PROMPT_FLAGS),
        prompt_lengths=args.prompt_lengths,
        requests_per_length=args.requests_per_length,
        max_tokens=args.max_tokens,
        warmup=args.warmup,
    )
    command = command_line("e2e", args, LONG_PROMPT_FLAGS)
    result = run_async(run_long_prompt(cfg, command=command, show_progress=not args.no_progress))
    _no_chart(args)
    return finish(args, result, format_long_prompt(result), None)


def _multi_turn(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.multi_turn import MultiTurnConfig, format_multi_turn, run_multi_turn

    cfg = MultiTurnConfig(
        setup=_setup_config(args, MULTI_TURN_FLAGS),
        turns=args.turns,
        conversations=args.conversations,
        first_turn_tokens=args.first_turn_tokens,
        turn_tokens=args.turn_tokens,
        max_tokens=args.max_tokens,
        warmup=args.warmup,
        prefix_cache_blocks=args.prefix_cache_blocks,
    )
    command = command_line("e2e", args, MULTI_TURN_FLAGS)
    result = run_async(run_multi_turn(cfg, command=command, show_progress=not args.no_progress))
    _no_chart(args)
    return finish(args, result, format_multi_turn(result), None)


def _repeat(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.repeat import RepeatConfig, format_repeat, run_repeat

    cfg = RepeatConfig(
        setup=_setup_config(args, REPEAT_FLAGS),
        prompts=args.prompts,
        repeats=args.repeats,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        warmup=args.warmup,
    )
    command = command_line("e2e", args, REPEAT_FLAGS)
    result = run_async(run_repeat(cfg, command=command, show_progress=not args.no_progress))
    _no_chart(args)
    return finish(args, result, format_repeat(result), None)
