"""The colocated baseline of `bench e2e`: one process that prefills and decodes, behind the same
DecodeService.Generate API as the decode service, so the same client measures both setups.

Same engine, same cache layout (decode's TP), same boundary (at full, the first token is the
one prefill sampled, sent before any decode step), same single compute thread for model calls,
same step loop (shared/runtime/step_loop.py: concurrent requests decode in one step, each token
streamed as its step ends) as the decode service; blocks for prompt + max_tokens are allocated
up front; no NIXL, no prefill peer. Prefills and the decode steps of concurrent requests share
the one compute thread, which is the interference disaggregation removes.

    python -m hybridpd_tools.bench.colocated_server --model tiny-mamba2 --engine reference --tp 1 --num-blocks N
    python -m hybridpd_tools.bench.colocated_server --engine hf --model CHECKPOINT_DIR --tp 1 --num-blocks N

prints `LISTENING port=N` (port 0 by default picks a free one) and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from decode_svc.request import DEFAULT_TIMEOUT_SECONDS
from decode_svc.request_options import decode_options, finish_reason_message
from shared.engine.factory import ENGINE_KINDS
from shared.errors import InvalidArgument
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.proto_time import duration
from shared.rpc.server import build_server
from shared.rpc.service import announce_port
from shared.rpc.token_ids import token_list
from shared.runtime.colocated import Colocated, RunTimes


class ColocatedServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, colocated: Colocated) -> None:
        self.engine = colocated.engine
        self.colocated = colocated  # the decode service's step loop

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        started = time.monotonic()
        prompt = token_list(request.prompt_token_ids)
        if not prompt or request.max_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give prompt_token_ids and max_tokens >= 1")
        try:
            options = decode_options(request, self.engine)  # the decode service's own rules
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)
        key = request.request_id or uuid.uuid4().hex
        deadline = asyncio.get_running_loop().time() + (context.time_remaining() or DEFAULT_TIMEOUT_SECONDS)
        times = RunTimes()
        generated, finish = 0, None
        tokens = self.colocated.stream(
            key, prompt, request.max_tokens, sampling=options.sampling, stop=options.stop, deadline=deadline, times=times
        )
        async with contextlib.aclosing(tokens):
            async for token in tokens:
                generated, finish = generated + 1, token.finish
                yield pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[token.token_id]))
        assert finish is not None
        yield pb.GenerateResponse(
            summary=pb.GenerateSummary(
                request_id=key,
                prompt_token_count=len(prompt),
                generated_token_count=generated,
                finish_reason=finish_reason_message(finish),
                seed=options.sampling.seed,
                prefill_duration=duration(times.prefill_seconds),
                prefill_engine_duration=duration(times.engine_seconds),
                first_step_engine_duration=duration(times.first_step_seconds),
                time_to_first_token=duration((times.first_token_at or time.monotonic()) - started),
                total_duration=duration(time.monotonic() - started),
            )
        )

    async def GetLayout(self, request: pb.GetLayoutRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.GetLayoutResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the colocated benchmark server has no layout to share")
        raise AssertionError("abort raises")


def colocated_servicer(
    kind: str,
    model: str,
    tp: int,
    num_blocks: int,
    *,
    kernel_block_size: int = 16,
    dtype: str | None = None,
    device: str = "cpu",
    boundary: str | None = None,
    prefill_chunk_tokens: int = 0,
) -> ColocatedServicer:
    """The servicer over a fresh engine (`Colocated.build`)."""
    colocated = Colocated.build(
        kind,
        model,
        tp,
        num_blocks,
        kernel_block_size=kernel_block_size,
        dtype=dtype,
        device=device,
        boundary=boundary,
        prefill_chunk_tokens=prefill_chunk_tokens,
    )
    return ColocatedServicer(colocated)


async def serve(args: argparse.Namespace) -> None:
    servicer = colocated_servicer(
        args.engine,
        args.model,
        args.tp,
        args.num_blocks,
        kernel_block_size=args.kernel_block_size,
        dtype=args.dtype,
        device=args.device,
        boundary=args.boundary,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
    )
    server = build_server()
    pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announce_port(port)
    await stop.wait()
    await server.stop(1.0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-mamba2", help="a preset, or with --engine hf a checkpoint directory")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="--engine hf: compute dtype")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--boundary", choices=("n-1", "full"), default=None, help="as the services' (default: full for hf)")
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="reference")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--kernel-block-size", type=int, default=16)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--prefill-chunk-tokens", type=int, default=0, help="as the prefill service's: the hf engine prefills in these chunks"
    )
    args = parser.parse_args(argv)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
