"""HTTP front door vs gRPC Generate on the same pair, same run (`python -m hybridpd_tools.bench.http_front`).

One prefill + one decode service in this process (real grpc.aio and uvicorn servers on port 0,
real NIXL READs over UCX on DRAM, the tiny reference model), requests strictly one at a time and
interleaved (gRPC, HTTP, gRPC, ...) so drift hits both sides alike:

- latency: tiny prompt, max_tokens=1, the whole response; gRPC through a grpc.aio stub,
  HTTP through one keep-alive connection (asyncio streams + h11);
- first chunk: streamed, max_tokens=16; time from sending the request to the first token
  chunk (gRPC) or the first SSE event carrying text (HTTP).
Prints medians and p90s, and the added median per request (HTTP - gRPC).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import grpc
import h11

from hybridpd_tools.bench.stats import median, percentile
from shared.config import parse_settings
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.runtime.engine_host import engine_factory_for


class HttpConnection:
    """One keep-alive HTTP/1.1 connection; `post` returns the status, the time to the first body
    piece that carries text, and the whole body."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> HttpConnection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, float, bytes]:
        data = json.dumps(body).encode()
        headers = [("Host", "127.0.0.1"), ("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        started = time.perf_counter()
        self.writer.write(self.conn.send(h11.Request(method="POST", target=path, headers=headers)) or b"")
        self.writer.write(self.conn.send(h11.Data(data=data)) or b"")
        self.writer.write(self.conn.send(h11.EndOfMessage()) or b"")
        await self.writer.drain()
        status, first, chunks = 0, 0.0, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.reader.read(65536))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                if not first and b'"text":"' in event.data and b'"text":""' not in event.data:
                    first = time.perf_counter() - started
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.conn.start_next_cycle()
                return status, first, b"".join(chunks)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def grpc_call(stub: pb_grpc.DecodeServiceStub, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(time to the first token chunk, time to the end of the stream)."""
    started = time.perf_counter()
    first = 0.0
    call: Any = stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), timeout=30)
    async for reply in call:
        if not first and reply.HasField("chunk") and reply.chunk.token_ids:
            first = time.perf_counter() - started
    return first, time.perf_counter() - started


def line(name: str, samples: Sequence[float]) -> str:
    return f"{name:<34} median {median(samples) * 1e3:8.3f} ms   p90 {percentile(samples, 90) * 1e3:8.3f} ms   (n={len(samples)})"


async def run(requests: int, model: str) -> dict[str, float]:
    from decode_svc.app import DecodeApp
    from prefill_svc.app import PrefillApp

    common = ["--model", model, "--engine", "reference", "--num-blocks", "64", "--port", "0", "--log-level", "WARNING"]
    factory = engine_factory_for("reference")
    prefill = await PrefillApp.start(parse_settings("prefill", common, environ={}), factory)
    decode = None
    try:
        decode = await DecodeApp.start(
            parse_settings(
                "decode",
                # Reuse off: both fronts run the whole path for every request.
                [*common, "--http-port", "0", "--prefix-cache-blocks", "0", "--prefill", f"127.0.0.1:{prefill.port}"],
                environ={},
            ),
            factory,
        )
        await decode.wait_ready(30)
        assert decode.shell.http_port is not None
        http = await HttpConnection.open(decode.shell.http_port)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}")
        stub = pb_grpc.DecodeServiceStub(channel)
        lat_grpc: list[float] = []
        lat_http: list[float] = []
        first_grpc: list[float] = []
        first_http: list[float] = []
        body = {"prompt": "hi", "max_tokens": 1}
        stream_body = {"prompt": "hi", "max_tokens": 16, "stream": True}
        for i in range(requests + 10):  # the first 10 of each are warm-up
            _, g = await grpc_call(stub, "hi", 1)
            t0 = time.perf_counter()
            status, _, _ = await http.post("/v1/completions", body)
            h = time.perf_counter() - t0
            assert status == 200, status
            gf, _ = await grpc_call(stub, "hi", 16)
            status, hf, _ = await http.post("/v1/completions", stream_body)
            assert status == 200 and hf > 0, status
            if i >= 10:
                lat_grpc.append(g)
                lat_http.append(h)
                first_grpc.append(gf)
                first_http.append(hf)
        await http.close()
        await channel.close()
    finally:
        if decode is not None:
            await decode.stop()
        await prefill.stop()
    print(line("gRPC Generate, max_tokens=1", lat_grpc))
    print(line("HTTP /v1/completions, max_tokens=1", lat_http))
    print(line("gRPC first token chunk (stream)", first_grpc))
    print(line("HTTP first SSE text event", first_http))
    added = median(lat_http) - median(lat_grpc)
    added_first = median(first_http) - median(first_grpc)
    print(f"added median latency per request (HTTP - gRPC): {added * 1e3:.3f} ms; first chunk: {added_first * 1e3:.3f} ms")
    return {"added_ms": added * 1e3, "added_first_ms": added_first * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridpd_tools.bench.http_front", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--requests", type=int, default=200, help="measured requests per kind (after 10 warm-up)")
    parser.add_argument("--model", default="tiny-mamba2")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    from shared.runtime.process import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory(args.loop)) as runner:
        runner.run(run(args.requests, args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
