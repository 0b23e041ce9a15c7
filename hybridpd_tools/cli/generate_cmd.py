"""`hybrid-pd generate`: send one Generate request to a decode service and print the tokens.

Text is printed as it streams (a summary line goes to stderr); with `--json` one JSON object
is printed at the end: `request_id`, `token_ids`, `text`, `prompt_token_count` and `summary`.
On failure the gRPC status name and the server's message go to stderr and the exit code is 1.
A malformed or out-of-range value (each number within what the wire and the engine hold,
shared/limits.py) is refused before anything is sent: one line naming the flag, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from shared import limits
from shared.config import ENV_PREFIX, TlsSettings, existing_file, host_port
from shared.limits import FloatRange, IntRange
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.channel import build_channel
from shared.rpc.status import describe

DEFAULT_DECODE = "127.0.0.1:50052"
TIMEOUT = FloatRange(0.0, 1e9, open_low=True)  # seconds: the call's deadline


def _env(flag: str, default: str | None = None) -> str | None:
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def _arg_type(parse: Any) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected token ids separated by commas or spaces") from None
    bad = [i for i in ids if i not in limits.TOKEN_ID]
    if bad:
        raise argparse.ArgumentTypeError(f"token ids must be {limits.TOKEN_ID.describe()}, got {bad[0]}")
    return ids


def in_range(limit: IntRange | FloatRange) -> Callable[[str], float]:
    """argparse type: a number within `limit` (the message names the value; argparse the flag)."""

    def convert(text: str) -> float:
        try:
            value = int(text) if isinstance(limit, IntRange) else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {limit.describe()}, got {text!r}") from None
        if value not in limit:
            raise argparse.ArgumentTypeError(f"must be {limit.describe()}, got {text}")
        return value

    return convert


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="send one request to a decode service and print the generated tokens",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--decode",
        type=_arg_type(host_port),
        default=_env("decode", DEFAULT_DECODE),
        metavar="HOST:PORT",
        help=f"decode service address (env {ENV_PREFIX}DECODE; default {DEFAULT_DECODE})",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized by the service)")
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="IDS", help="prompt token ids, e.g. 72,101,108")
    p.add_argument(
        "--max-tokens", type=in_range(limits.MAX_TOKENS), default=16, metavar="N", help="tokens to generate (default 16)"
    )
    p.add_argument(
        "--min-tokens",
        type=in_range(limits.MIN_TOKENS),
        default=0,
        metavar="N",
        help="generate at least N tokens: EOS ids are masked until then (default 0; at most --max-tokens)",
    )
    p.add_argument("--request-id", default="", help="request id (default: the service makes one)")
    p.add_argument("--timeout", type=in_range(TIMEOUT), default=60.0, metavar="SECONDS", help="deadline of the call (default 60)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument(
        "--colocated",
        action="store_true",
        help="no services: run prefill and decode of the model in this process (the baseline "
        "disaggregated runs must equal); needs --model; prints the same shape of output",
    )
    p.add_argument(
        "--model",
        default=_env("model"),
        metavar="PRESET|DIR",
        help=f"with --colocated: the tiny reference model, e.g. tiny-mamba2, or with --engine paged|hf a "
        f"checkpoint directory (env {ENV_PREFIX}MODEL)",
    )
    p.add_argument(
        "--engine",
        choices=("reference", "paged", "hf"),
        default=_env("engine", "reference"),
        help="with --colocated: reference (tiny-*), paged (a Hugging Face checkpoint on the batched engine, "
        "through the decode service's step loop) or hf (a checkpoint run by transformers' generate path, "
        f"the oracle; env {ENV_PREFIX}ENGINE)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=_env("dtype"),
        help="with --colocated --engine hf: compute dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=_env("device", "cpu"),
        help="with --colocated --engine hf: where the model runs (default cpu)",
    )
    p.add_argument(
        "--boundary",
        choices=("n-1", "full"),
        default="full",
        help="with --colocated --engine hf: full (prefill all N, sample the first token from it: the "
        "services' default for --engine hf, bit-identical to transformers' generate()) or n-1 (prefill "
        "N-1 tokens, step the last); default full",
    )
    p.add_argument(
        "--temperature", type=in_range(limits.TEMPERATURE), default=0.0, help="sampling temperature; 0 = greedy (default)"
    )
    p.add_argument("--top-p", type=in_range(limits.TOP_P), default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--top-k", type=in_range(limits.TOP_K), default=0, help="keep the k likeliest tokens; 0 = off (default)")
    p.add_argument("--seed", type=in_range(limits.SEED), default=0, help="sampling seed in [0, 2**64) (default 0)")
    for name, what in (("cert", "client certificate (mutual TLS)"), ("key", "client private key"), ("ca", "CA bundle to trust")):
        p.add_argument(
            f"--tls-{name}",
            type=_arg_type(existing_file),
            default=_env(f"tls-{name}"),
            metavar="FILE",
            help=f"PEM {what} (env {ENV_PREFIX}TLS_{name.upper()})",
        )
    p.set_defaults(func=run)


async def _generate(args: argparse.Namespace) -> dict[str, Any]:
    request = pb.GenerateRequest(request_id=args.request_id, max_tokens=args.max_tokens, min_tokens=args.min_tokens)
    if args.temperature:
        request.sampling.CopyFrom(
            pb.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        )
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        request.prompt_token_ids.extend(args.prompt_ids)
    tls = TlsSettings(
        cert=Path(args.tls_cert) if args.tls_cert else None,
        key=Path(args.tls_key) if args.tls_key else None,
        ca=Path(args.tls_ca) if args.tls_ca else None,
    )
    token_ids: list[int] = []
    text: list[str] = []
    summary: pb.GenerateSummary | None = None
    async with build_channel(args.decode, tls if tls.enabled else None) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        async for response in stub.Generate(request, timeout=args.timeout):
            kind = response.WhichOneof("payload")
            if kind == "chunk":
                token_ids.extend(response.chunk.token_ids)
                text.append(response.chunk.text)
                if not args.json:
                    print(response.chunk.text, end="", flush=True)
            elif kind == "summary":
                summary = response.summary
    result: dict[str, Any] = {
        "request_id": summary.request_id if summary else args.request_id,
        "token_ids": token_ids,
        "text": "".join(text),
        "prompt_token_count": summary.prompt_token_count if summary else None,
        "summary": plain_numbers(summary, json_format.MessageToDict(summary, preserving_proto_field_name=True))
        if summary
        else None,
    }
    return result


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED64}


def plain_numbers(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    """Protobuf's JSON mapping writes 64-bit integers as strings and durations as "0.5s"; a
    script reading `--json` wants numbers: integers as integers, durations as seconds."""
    fields = message.DESCRIPTOR.fields_by_name
    for key, value in data.items():
        field = fields[key]
        if field.type in _INT64 and isinstance(value, str):
            data[key] = int(value)
        elif field.message_type is not None and field.message_type.full_name == "google.protobuf.Duration":
            data[key] = float(value.removesuffix("s"))
        elif field.message_type is not None and isinstance(value, dict):
            data[key] = plain_numbers(getattr(message, key), value)
    return data


def _summary_line(result: dict[str, Any]) -> str:
    s = result.get("summary") or {}
    transfer = s.get("transfer", {})
    ttft = s.get("time_to_first_token")
    return (
        f"[{len(result['token_ids'])} tokens, request {result['request_id']}, prefill {s.get('prefill_engine_id', '?')}, "
        f"{int(transfer.get('total_bytes', 0))} B in {transfer.get('read_count', 0)} READs, "
        f"time to first token {'?' if ttft is None else f'{ttft:.3f}s'}]"
    )


def _colocated_hf(args: argparse.Namespace) -> dict[str, Any]:
    """The hf engine's baseline: the checkpoint's tokenizer and model, one process, no blocks."""
    import os

    from shared.engine.hf.checkpoint import HfCheckpoint
    from shared.engine.hf.colocated import colocated_generate
    from shared.engine.hf.model_spec import compute_dtype
    from shared.engine.hf.tokenizer import HfTokenizer
    from shared.engine.sampling import SamplingParams

    if not args.model or not os.path.isdir(args.model):
        raise ValueError(f"--model: --engine hf needs a checkpoint directory, got {args.model!r}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    tokenizer = HfTokenizer(args.model)
    prompt = tokenizer.encode(args.prompt) if args.prompt is not None else list(args.prompt_ids)
    if not prompt:
        raise ValueError("--prompt: empty prompt, at least one token is needed")
    checkpoint = HfCheckpoint(
        args.model, dtype=compute_dtype(args.model, args.dtype), device="cuda:0" if args.device == "cuda" else "cpu"
    )
    if any(t >= checkpoint.vocab_size for t in prompt):
        raise ValueError(f"--prompt-ids: token ids must be < {checkpoint.vocab_size}")
    result = colocated_generate(
        checkpoint, prompt, args.max_tokens, boundary=args.boundary, sampling=sampling, min_tokens=args.min_tokens
    )
    return {
        "request_id": args.request_id,
        "token_ids": result.token_ids,
        "text": tokenizer.decode(result.token_ids),
        "prompt_token_count": len(prompt),
        "summary": None,
    }


def _colocated_paged(args: argparse.Namespace) -> dict[str, Any]:
    """The paged engine's baseline: prefill, then the decode service's step loop, one process."""
    import os

    from shared.engine.hf.tokenizer import HfTokenizer
    from shared.engine.sampling import SamplingParams, with_min_tokens
    from shared.engine.stopping import StopRule
    from shared.layout.page import build_engine_layout
    from shared.runtime.colocated import Colocated

    if not args.model or not os.path.isdir(args.model):
        raise ValueError(f"--model: --engine paged needs a checkpoint directory, got {args.model!r}")
    tokenizer = HfTokenizer(args.model)
    prompt = tokenizer.encode(args.prompt) if args.prompt is not None else list(args.prompt_ids)
    if not prompt:
        raise ValueError("--prompt: empty prompt, at least one token is needed")
    from shared.engine.hf.model_spec import hf_model_spec

    spec = hf_model_spec(args.model, dtype=args.dtype)
    if any(t >= spec.vocab_size for t in prompt):
        raise ValueError(f"--prompt-ids: token ids must be < {spec.vocab_size}")
    blocks = sum(build_engine_layout(spec, 1).blocks_per_group(len(prompt) + args.max_tokens))
    colocated = Colocated.build("paged", args.model, 1, blocks, dtype=args.dtype, device=args.device, boundary=args.boundary)
    eos = colocated.engine.eos_token_ids
    plain = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    sampling = with_min_tokens(plain, args.min_tokens, eos)
    stop = StopRule.of(args.max_tokens, eos, min_tokens=args.min_tokens)
    try:
        token_ids = asyncio.run(colocated.generate("colocated", prompt, args.max_tokens, sampling=sampling, stop=stop))
    finally:
        colocated.close()
    return {
        "request_id": args.request_id,
        "token_ids": token_ids,
        "text": tokenizer.decode(token_ids),
        "prompt_token_count": len(prompt),
        "summary": None,
    }


def _colocated(args: argparse.Namespace) -> dict[str, Any]:
    """The one-process baseline: same tokenizer, same model, no transfer."""
    if args.engine == "hf":
        return _colocated_hf(args)
    if args.engine == "paged":
        return _colocated_paged(args)
    from shared.engine.reference import colocated_generate, decode, encode
    from shared.layout.presets import TINY_PRESETS

    if args.model not in TINY_PRESETS:
        raise ValueError(
            f"--model: --colocated runs the reference models ({', '.join(sorted(TINY_PRESETS))}), got {args.model!r}"
        )
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    prompt = encode(args.prompt) if args.prompt is not None else list(args.prompt_ids)
    if not prompt:
        raise ValueError("--prompt: empty prompt, at least one token is needed")
    if any(t >= TINY_PRESETS[args.model].vocab_size for t in prompt):
        raise ValueError(f"--prompt-ids: token ids must be < {TINY_PRESETS[args.model].vocab_size}")
    token_ids = colocated_generate(TINY_PRESETS[args.model], prompt, args.max_tokens)
    return {
        "request_id": args.request_id,
        "token_ids": token_ids,
        "text": decode(token_ids),
        "prompt_token_count": len(prompt),
        "summary": None,
    }


def run(args: argparse.Namespace) -> int:
    import grpc

    if args.colocated:
        try:
            result = _colocated(args)
        except ValueError as e:
            print(f"INVALID_ARGUMENT: {e}", file=sys.stderr)
            return 1
        print(json.dumps(result) if args.json else result["text"])
        return 0
    try:
        result = asyncio.run(_generate(args))
    except grpc.aio.AioRpcError as e:
        failure = describe(e)
        print(f"{failure.status}: {failure.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print()
        print(_summary_line(result), file=sys.stderr)
    return 0
