"""The client host's process: gRPC calls and metrics scrapes made from inside a host namespace.

The test process lives outside every host, so it cannot open a connection to one; it starts this
module on the client host (`python -m tests.hosts.driver`) and talks to it over stdin/stdout, one
JSON object per line. Requests carry an `id` and an `op`; every reply carries the same `id`.
Calls run concurrently.

    {"id": 1, "op": "generate", "target": "10.203.7.11:50052", "request_id": "r1",
     "prompt": [1, 2, 3], "max_tokens": 8, "timeout": 30}
        -> {"id": 1, "status": "OK" | "<gRPC status name>", "message": "...", "tokens": [...],
            "seconds": 0.12, "state_verified": true, "num_transferred_tokens": 2}
    {"id": 2, "op": "metrics", "url": "http://10.203.7.10:9100/metrics"}
        -> {"id": 2, "samples": {"name{label=value}": 1.0, ...}}
    {"id": 3, "op": "health", "target": "...", "service": "hybridpd.v1.DecodeService"}
        -> {"id": 3, "status": "SERVING" | "NOT_SERVING" | "<gRPC status name>"}
    {"id": 4, "op": "peers", "target": "..."}  -> {"id": 4, "peers": [{"target": ..., "state": ...}]}
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from tests.decode_stream import settled
from tests.metric_samples import scrape


async def generate(req: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    request = dpb.GenerateRequest(request_id=req["request_id"], prompt_token_ids=req["prompt"], max_tokens=req["max_tokens"])
    got = await settled(req["target"], request, timeout=req.get("timeout", 60))
    status, message = ("OK", "") if got.failure is None else (got.failure.status, got.failure.message)
    summary = got.summary_or_empty()
    return {
        "status": status,
        "message": message,
        "tokens": got.tokens,
        "seconds": time.monotonic() - started,
        "state_verified": summary.state_verified,
        "num_transferred_tokens": summary.num_transferred_tokens,
    }


def metrics(url: str) -> dict[str, Any]:
    return {"samples": scrape(url)}


async def health(req: dict[str, Any]) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(req["target"]) as channel:
        try:
            stub: Any = health_pb2_grpc.HealthStub(channel)  # its stubs carry no method types
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=req["service"]), timeout=2)
        except grpc.aio.AioRpcError as e:
            return {"status": e.code().name}
    return {"status": health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}


async def peers(req: dict[str, Any]) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(req["target"]) as channel:
        reply = await dpb_grpc.DecodeServiceStub(channel).GetLayout(dpb.GetLayoutRequest(), timeout=5)
    return {
        "peers": [
            {"target": p.target, "state": dpb.PeerState.Name(p.state), "engine_id": p.engine_id, "last_error": p.last_error}
            for p in reply.peers
        ]
    }


async def handle(req: dict[str, Any]) -> None:
    try:
        op = req["op"]
        if op == "generate":
            result = await generate(req)
        elif op == "metrics":
            result = await asyncio.to_thread(metrics, req["url"])
        elif op == "health":
            result = await health(req)
        elif op == "peers":
            result = await peers(req)
        else:
            result = {"error": f"unknown op {op!r}"}
    except Exception as e:  # the test reads the failure; the driver keeps serving
        result = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps({"id": req["id"], **result}) + "\n")
    sys.stdout.flush()


async def main() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    print("DRIVER ready", flush=True)
    while line := await reader.readline():
        task = asyncio.ensure_future(handle(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


if __name__ == "__main__":
    asyncio.run(main())
