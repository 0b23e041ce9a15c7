"""`hybrid-pd demo`: the whole service pair on this machine, checked on every request.

For each model it starts a prefill and a decode service as subprocesses on free ports, sends
requests concurrently, and checks every one: with the reference engine the tokens must equal a
colocated run of the same model in this process, bit for bit; with either engine the decode
service compares every transferred byte with what prefill must have written (--check-state).
With the reference engine it also runs one Hugging Face family (--hf-family, default qwen3_5):
a tiny seeded checkpoint, made on first run and cached (nothing is downloaded), text through its
own BPE tokenizer, on `--engine paged` (the batched engine: tokens equal to each request run
alone, though the requests decoded in shared steps) and `--engine hf` (tokens equal to
transformers run colocated).
It prints a summary table, stops both services with SIGTERM (they must exit 0), and exits
non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import duration_pb2

from hybridpd_tools.bench.local_pair import LocalPair, ServiceStartError, start_pair
from shared.layout.presets import TINY_PRESETS
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc

TEXT = (
    "Hybrid models interleave state space layers with attention; the prefill engine computes "
    "their state and the decode engine reads it with one NIXL READ per rank pair. "
)
# Lengths around the tiny models' block sizes (16, 32, 48) and below the conv window (K-1 = 3).
PROMPT_LENGTHS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 101, 7, 40)


@dataclass
class RequestResult:
    prompt: str
    token_ids: list[int] = field(default_factory=list)
    summary: Any = None
    error: str = ""
    expected: list[int] | None = None

    @property
    def exact(self) -> bool:
        if self.error or self.summary is None or not self.summary.state_verified:
            return False
        return self.expected is None or self.token_ids == self.expected


def prompts(count: int) -> list[str]:
    text = TEXT * 4
    return [text[: PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] + i // len(PROMPT_LENGTHS)] for i in range(count)]


async def run_one(stub: pb_grpc.DecodeServiceAsyncStub, prompt: str, max_tokens: int, sem: asyncio.Semaphore) -> RequestResult:
    result = RequestResult(prompt)
    async with sem:
        try:
            call = stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), timeout=120.0)
            async for reply in call:
                if reply.HasField("chunk"):
                    result.token_ids.extend(reply.chunk.token_ids)
                else:
                    result.summary = reply.summary
        except grpc.aio.AioRpcError as e:
            result.error = f"{e.code().name}: {e.details()}"
    return result


def _ms(duration: duration_pb2.Duration) -> float:
    return float(duration.seconds) * 1e3 + duration.nanos / 1e6


def summarize(model: str, engine: str, p_tp: int, d_tp: int, results: list[RequestResult], wall: float) -> dict[str, Any]:
    done = [r for r in results if r.summary is not None]
    fa = sum(r.summary.transfer.attention_bytes for r in done)
    conv = sum(r.summary.transfer.conv_bytes for r in done)
    ssm = sum(r.summary.transfer.ssm_bytes for r in done)
    read_s = sum(_ms(r.summary.read_duration) for r in done) / 1e3
    total = fa + conv + ssm
    return {
        "model": model,
        "engine": engine,
        "prefill_tp": p_tp,
        "decode_tp": d_tp,
        "requests": len(results),
        "exact": sum(r.exact for r in results),
        "errors": [r.error for r in results if r.error],
        "bytes": {"fa": fa, "conv": conv, "ssm": ssm, "total": total},
        "reads": sum(r.summary.transfer.read_count for r in done),
        "read_ms_p50": statistics.median([_ms(r.summary.read_duration) for r in done]) if done else 0.0,
        "read_gbps": total / read_s / 1e9 if read_s > 0 else 0.0,
        "ttft_ms_p50": statistics.median([_ms(r.summary.time_to_first_token) for r in done]) if done else 0.0,
        "wall_s": wall,
    }


async def demo_model(args: argparse.Namespace, model: str, engine: str) -> tuple[dict[str, Any], list[RequestResult]]:
    common = ["--model", model, "--engine", engine, "--num-blocks", str(args.num_blocks)]
    name = _label(model, engine).replace(":", "-")
    prefill_args = [*common, "--tp", str(args.prefill_tp), "--engine-id", f"demo-prefill-{name}"]
    if args.prefill_block_size:
        prefill_args += ["--block-size", str(args.prefill_block_size)]
    decode_args = [*common, "--tp", str(args.decode_tp), "--engine-id", f"demo-decode-{name}", "--check-state"]
    if args.decode_block_size:
        decode_args += ["--block-size", str(args.decode_block_size)]
    pair: LocalPair = await start_pair(prefill_args, decode_args)
    try:
        texts = prompts(args.requests)
        sem = asyncio.Semaphore(args.concurrency)
        start = time.perf_counter()
        async with grpc.aio.insecure_channel(pair.decode.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            results = await asyncio.gather(*(run_one(stub, t, args.max_tokens, sem) for t in texts))
        wall = time.perf_counter() - start
    finally:
        codes = pair.stop()
    if engine == "reference":
        from shared.engine.reference.colocated import colocated_generate
        from shared.engine.reference.tokenizer import encode

        spec = TINY_PRESETS[model]
        for r in results:
            r.expected = colocated_generate(spec, encode(r.prompt), args.max_tokens)
    elif engine == "hf":
        _expect_hf(model, results, args.max_tokens)
    elif engine == "paged":
        await _expect_paged(model, results, args.max_tokens)
    row = summarize(_label(model, engine), engine, args.prefill_tp, args.decode_tp, list(results), wall)
    row["exit_codes"] = {"decode": codes[0], "prefill": codes[1]}
    if codes != (0, 0):
        row["errors"].append(f"services exited with codes decode={codes[0]} prefill={codes[1]}, expected 0")
    return row, list(results)


def _label(model: str, engine: str) -> str:
    return f"hf:{os.path.basename(model).split('-seed')[0]}" if engine in ("hf", "paged") else model


def _expect_hf(directory: str, results: list[RequestResult], max_tokens: int) -> None:
    """transformers run colocated, at the services' boundary for --engine hf (full), stopping at the same EOS ids."""
    from shared.engine.hf.checkpoint import HfCheckpoint
    from shared.engine.hf.colocated import colocated_generate
    from shared.engine.hf.model_spec import compute_dtype
    from shared.engine.hf.tokenizer import HfTokenizer

    tokenizer = HfTokenizer(directory)
    checkpoint = HfCheckpoint(directory, dtype=compute_dtype(directory, None))
    for r in results:
        r.expected = colocated_generate(checkpoint, tokenizer.encode(r.prompt), max_tokens, boundary="full").token_ids


async def _expect_paged(directory: str, results: list[RequestResult], max_tokens: int) -> None:
    """Each request alone on the paged engine in this process (prefill, then the step loop), at
    the services' boundary for it (full), stopping at the same EOS ids: what it computed beside
    the demo's other requests must equal it bit for bit."""
    from shared.engine.hf.tokenizer import HfTokenizer
    from shared.engine.stopping import StopRule
    from shared.runtime.colocated import Colocated

    tokenizer = HfTokenizer(directory)
    colocated = await asyncio.to_thread(Colocated.build, "paged", directory, 1, 256)
    try:
        stop = StopRule.of(max_tokens, colocated.engine.eos_token_ids)
        for i, r in enumerate(results):
            r.expected = await colocated.generate(f"alone-{i}", tokenizer.encode(r.prompt), max_tokens, stop=stop)
    finally:
        colocated.close()


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'model':<24} {'P→D':>5} {'engine':<9} {'exact':>7} {'FA KiB':>9} {'conv KiB':>9} {'SSM KiB':>9} {'READs':>6} {'READ ms':>8} {'GB/s':>6} {'TTFT ms':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        b = r["bytes"]
        print(
            f"{r['model']:<24} {str(r['prefill_tp']) + '→' + str(r['decode_tp']):>5} {r['engine']:<9} "
            f"{str(r['exact']) + '/' + str(r['requests']):>7} {b['fa'] / 1024:>9.1f} {b['conv'] / 1024:>9.1f} "
            f"{b['ssm'] / 1024:>9.1f} {r['reads']:>6} {r['read_ms_p50']:>8.2f} {r['read_gbps']:>6.2f} {r['ttft_ms_p50']:>8.1f}"
        )


async def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    failed = False
    runs = [(model, args.engine) for model in args.model]
    if args.engine == "reference" and args.hf_family != "none":
        if not args.json:
            print(f"making (or reusing) the tiny {args.hf_family} checkpoint ...", flush=True)
        from shared.engine.hf.tiny_checkpoints import cached_checkpoint

        checkpoint = cached_checkpoint(args.hf_family)
        runs += [(checkpoint, "paged"), (checkpoint, "hf")]
    for model, engine in runs:
        if not args.json:
            print(
                f"running {_label(model, engine)}: prefill TP {args.prefill_tp} -> decode TP {args.decode_tp}, "
                f"{args.requests} requests, {engine} engine ...",
                flush=True,
            )
        try:
            row, results = await demo_model(args, model, engine)
        except ServiceStartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        rows.append(row)
        for r in results:
            if not r.exact:
                failed = True
                why = r.error or (
                    "state not verified"
                    if r.summary is None or not r.summary.state_verified
                    else f"tokens {r.token_ids} != colocated {r.expected}"
                )
                print(f"MISMATCH {_label(model, engine)} prompt of {len(r.prompt.encode())} bytes: {why}", file=sys.stderr)
        failed = failed or bool(row["errors"])
    if args.json:
        print(json.dumps({"rows": rows, "ok": not failed}, indent=2))
    else:
        print()
        print_table(rows)
        print()
        exact = "exact" if args.engine == "reference" else "every byte verified"
        print(
            f"{'FAILED' if failed else 'OK'}: {sum(r['exact'] for r in rows)}/{sum(r['requests'] for r in rows)} requests {exact}"
        )
    return 1 if failed else 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="start a prefill and a decode service locally, send requests, check every one",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="PRESET",
        help="model preset; repeat for several (default: every tiny reference model)",
    )
    p.add_argument(
        "--engine",
        choices=("reference", "synthetic"),
        default="reference",
        help="reference: tiny seeded model, tokens compared with a colocated run (default); "
        "synthetic: verifiable patterns at real-model sizes",
    )
    p.add_argument(
        "--hf-family",
        default="qwen3_5",
        help="with the reference engine, also run this Hugging Face family's tiny checkpoint through --engine hf "
        "(made on first run, cached under $HYBRID_PD_CACHE or ~/.cache/hybrid-pd); none: skip (default qwen3_5)",
    )
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill TP size (default 2)")
    p.add_argument("--decode-tp", type=int, default=4, help="decode TP size (default 4)")
    p.add_argument("--prefill-block-size", type=int, default=0, help="prefill logical block size (default: minimum)")
    p.add_argument("--decode-block-size", type=int, default=0, help="decode logical block size (default: minimum)")
    p.add_argument("--requests", type=int, default=16, help="requests per model (default 16)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per request (default 24)")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="cache blocks per engine (default 256 with the reference engine, 24 with synthetic: real pages are MiBs)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=lambda a: asyncio.run(run(_defaults(a))))


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    if not args.model:
        args.model = sorted(TINY_PRESETS) if args.engine == "reference" else ["nemotron-3-nano-30b-a3b"]
    if not args.num_blocks:
        args.num_blocks = 256 if args.engine == "reference" else 24
    return args
