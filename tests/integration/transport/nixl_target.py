"""A rank that is only read from, in its own process, for the two-process transport tests.

It fills its cache with a pattern that says (seed, region, byte position), registers
it, prints one JSON line describing itself (agent metadata, base addresses), pumps
notifications with a CompletionPoller, and then follows commands on stdin:

    expect KEY COUNT   wait for COUNT notifications KEY; prints {"resolved": ...} when done
    quit               close and exit

Every notification nobody waits for is printed as {"unknown": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading

import torch

from shared.cache.regions import RankCache
from shared.transport.agent import RankAgent
from shared.transport.poller import CompletionPoller


def fill_pattern(cache: RankCache, seed: int) -> None:
    """Every 8 bytes hold a value unique to (seed, region, position)."""
    for region, tensor in enumerate(cache.regions):
        first = (seed << 40) + (region << 32)
        torch.arange(first, first + cache.region_bytes // 8, dtype=torch.int64, out=tensor.view(torch.int64))


def emit(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    cache = RankCache(args.regions, args.num_blocks, args.page_bytes)
    fill_pattern(cache, args.seed)
    agent = await RankAgent.create(args.engine_id, args.rank, incarnation=args.incarnation)
    await cache.register(agent)
    poller = CompletionPoller(
        idle_interval=0.001,
        on_unknown_notif=lambda _, sender, msg: emit({"unknown": msg.decode(), "sender": sender}),
    )
    poller.attach(agent)
    emit(
        {
            "name": agent.name,
            "metadata": (await agent.metadata()).hex(),
            "bases": cache.base_addresses().tolist(),
            "mem_type": cache.place.mem_type,
            "device_id": cache.place.device_id,
        }
    )

    commands: asyncio.Queue[str] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, "quit")

    threading.Thread(target=read_stdin, daemon=True).start()

    async def report(key: str, waiting: asyncio.Future[list[str]]) -> None:
        emit({"resolved": key, "senders": await waiting})

    tasks: set[asyncio.Task[None]] = set()
    while True:
        command = await commands.get()
        if command == "quit":
            break
        verb, key, count = command.split()
        assert verb == "expect"
        task = asyncio.ensure_future(report(key, poller.expect(agent, key.encode(), int(count))))
        tasks.add(task)
        emit({"expecting": key})
    await poller.aclose()
    await agent.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine-id", default="target")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--incarnation", default=None)
    parser.add_argument("--regions", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--page-bytes", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
