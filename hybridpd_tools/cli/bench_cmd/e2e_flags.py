"""`hybrid-pd bench e2e`: its parser, every workload's flags."""

from __future__ import annotations

import argparse
from typing import Any

from hybridpd_tools.cli.bench_cmd.args import add, common, doc, lengths, levels, non_negative, positive, tp_flags
from hybridpd_tools.cli.bench_cmd.e2e import WORKLOADS, run
from hybridpd_tools.cli.bench_cmd.running import guarded


def add_parser(sub: Any) -> None:
    """`hybrid-pd bench e2e`."""
    e = sub.add_parser(
        "e2e",
        help="TTFT, inter-token latency, tokens/s: disaggregated vs colocated",
        description="\n\n".join(
            doc(m)
            for m in (
                "hybridpd_tools.bench.e2e",
                "hybridpd_tools.bench.long_prompt",
                "hybridpd_tools.bench.multi_turn",
                "hybridpd_tools.bench.repeat",
            )
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add(
        e,
        "workload",
        "concurrency",
        "concurrency (levels of concurrent requests), long-prompt (TTFT and bytes per prompt length), "
        "multi-turn (conversations, each turn extending the previous one) or repeat (the same prompts again, with and "
        "without decode's state checkpoints)",
        choices=WORKLOADS,
    )
    add(
        e,
        "model",
        None,
        "model preset, or with --engine hf a checkpoint directory (default: tiny-mamba2; with --engine hf the "
        "tiny --hf-family checkpoint, made on first use)",
        metavar="PRESET|DIR",
    )
    add(
        e,
        "engine",
        None,
        "reference (tiny models, real math), synthetic (real-model sizes, no math), paged (a Hugging Face "
        "checkpoint on the batched engine) or hf (a checkpoint run by transformers); default reference for the "
        "concurrency workload, hf for long-prompt and multi-turn",
        choices=("reference", "synthetic", "paged", "hf"),
    )
    add(e, "hf-family", "nemotron_h", "with --engine hf and no --model: the family of the tiny checkpoint", metavar="FAMILY")
    add(
        e,
        "hf-size",
        "tiny",
        "with --engine hf and no --model: tiny (the tests' checkpoint) or small (nemotron_h only, about 60x the "
        "compute per token: a 2k-token prefill then costs what a real one does relative to the network hops)",
        choices=("tiny", "small"),
    )
    add(e, "concurrency", "1,2,4,8", "concurrency levels, e.g. 1,2,4,8,16,32,64", type=levels, metavar="LIST")
    add(
        e,
        "prompt-tokens",
        128,
        "prompt length (2048 for the TTFT target; the reference engine takes seconds per prompt)",
        type=positive,
        metavar="N",
    )
    add(e, "max-tokens", 32, "tokens generated per request", type=positive, metavar="N")
    add(e, "requests-per-level", 0, "requests per level and setup (0: max(4, 2 x concurrency))", type=non_negative, metavar="K")
    add(e, "warmup", 2, "unmeasured requests per setup before the first level", type=non_negative, metavar="N")
    add(
        e,
        "interleave",
        2,
        "parts per level, run alternately on the two setups (= requests: one by one)",
        type=positive,
        metavar="N",
    )
    tp_flags(e)
    _add_thread_flags(e)
    add(
        e,
        "boundary",
        None,
        "concurrency: where prefill stops, as the services' --boundary: full (prefill samples the first token; "
        "hf only) or n-1; default the engine's (full for hf). Sets the TTFT target: 1.02 at full, 1.10 at n-1. "
        "long-prompt too: at full the first token leaves before the READ, so TTFT holds no transfer; n-1 puts it back. "
        "repeat too: at full a state checkpoint also keeps the first token prefill drew",
        choices=("full", "n-1"),
    )
    _add_long_prompt_flags(e)
    _add_multi_turn_and_repeat_flags(e)
    common(e)
    e.set_defaults(func=guarded(run))


def _add_thread_flags(e: argparse.ArgumentParser) -> None:
    """bench e2e: the services' compute threads (no default here: omitted, the services' own applies)."""
    # Not passed to the colocated baseline: it stands for one process whose prefills and decode
    # steps share one compute thread, the interference disaggregation removes.
    add(
        e,
        "prefill-threads",
        None,
        "the prefill service's --prefill-threads: threads that compute a batched prefill step (--engine paged); "
        "omitted: not passed, the service's default applies. The colocated baseline keeps one compute thread, so the "
        "disaggregated/colocated ratios include the threads' gain",
        type=positive,
        metavar="N",
    )
    add(
        e,
        "decode-threads",
        None,
        "the decode services' --decode-threads: threads that compute a decode step (--engine paged); omitted: not "
        "passed, the service's default applies. The colocated baseline keeps one compute thread, so the "
        "disaggregated/colocated ratios include the threads' gain",
        type=positive,
        metavar="N",
    )


def _add_long_prompt_flags(e: argparse.ArgumentParser) -> None:
    """bench e2e: the long-prompt workload's flags (and the transfer modes multi-turn shares)."""
    add(e, "crossover-model", None, "model of the bytes-vs-prompt-length crossover (default: --model)", metavar="PRESET")
    add(
        e,
        "prompt-lengths",
        "8192,16384,32768",
        "long-prompt: prompt lengths (the tiny hf checkpoint prefills 32k tokens in ~15 s on two cores)",
        type=lengths,
        metavar="LIST",
    )
    add(e, "requests-per-length", 2, "long-prompt: prompts per length, each on both setups", type=positive, metavar="K")
    add(
        e,
        "prefill-chunk-tokens",
        0,
        "long-prompt: pipelined transfer (prefill and colocated compute in chunks of N; the decode service READs "
        "manifest parts meanwhile) measured against an unpipelined decode service on the same prefill, in the same "
        "run; multi-turn: the pair transfers in manifest parts (after the cached prefix with --prefix-cache-blocks); "
        "0: off",
        type=non_negative,
        metavar="N",
    )
    add(
        e,
        "manifest-part-tokens",
        0,
        "with --prefill-chunk-tokens: prefill sends a manifest part only once M more tokens are final, and after the "
        "chunk before the last (fewer parts, each paying the per-part costs once); 0: a part after every chunk",
        type=non_negative,
        metavar="M",
    )
    add(
        e,
        "layer-parts",
        0,
        "long-prompt, with --prefill-chunk-tokens: prefill sends the last chunk's state in L parts of consecutive "
        "model layers, each as soon as its layers are computed (the SSM state is final only in the last chunk); "
        "0: one last part",
        type=non_negative,
        metavar="L",
    )


def _add_multi_turn_and_repeat_flags(e: argparse.ArgumentParser) -> None:
    """bench e2e: the multi-turn and repeat workloads' flags."""
    add(e, "turns", 4, "multi-turn: turns per conversation", type=positive, metavar="K")
    add(e, "prompts", 3, "repeat: distinct prompts, each sent --repeats times", type=positive, metavar="N")
    add(e, "repeats", 3, "repeat: times each prompt is sent, in a row", type=positive, metavar="K")
    add(e, "conversations", 2, "multi-turn: conversations, each on both setups", type=positive, metavar="N")
    add(e, "first-turn-tokens", 2048, "multi-turn: the first turn's prompt length", type=positive, metavar="N")
    add(
        e,
        "turn-tokens",
        256,
        "multi-turn: each later turn's new user message, after the previous answer",
        type=positive,
        metavar="N",
    )
    add(
        e,
        "prefix-cache-blocks",
        0,
        "multi-turn: --prefix-cache-blocks on the decode service and on prefill (its boundary cache, with "
        "--prefill-chunk-tokens on the paged engine), each with that many blocks more (0: no prefix reuse, the baseline)",
        type=non_negative,
        metavar="N",
    )
