"""The process the raw NIXL baselines read from: plain agents, nothing of ours in between.

`python -m hybridpd_tools.bench.raw_target --ranks P --regions R --region-bytes B` creates P plain
NIXL agents (no progress thread, as the services run them), registers R pre-faulted regions of
B bytes with each (the services' kind of memory: on huge pages unless `--huge-pages off`),
or, with `--device cuda`, R regions of rank r's GPU memory (cuda:r, as the services place ranks),
prints one JSON line (`ranks`: name, metadata as hex, region base addresses), then pumps every
agent about every millisecond while idle (the target side must progress UCX: wire-up answers,
notifications) until its stdin closes.

A `rewrite` line on stdin rewrites every region with new bytes and answers `ok`: like a
prefill engine that has just written a request's state, so a baseline READ finds its source
freshly written, as ours does (re-reading untouched memory measured a few % faster here).

A `serve PUMPING COUNT TAG` line rewrites likewise, answers `ok`, then pumps every agent as
strategy PUMPING says (raw_pumping.py) until COUNT notifications TAG (hex) have arrived: what a
prefill that has just offered its state does while the READs are in flight (ours pumps its
agents at the busy rate until the READ's notification, prefill_svc/pins.py). Over TCP this
pumping is what serves the READ. A new line on stdin ends it early (the reader gave up).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridpd_tools.bench.raw_memory import region_buffer
from hybridpd_tools.bench.raw_pumping import pause
from shared.transport.nixl_env import load_nixl

PUMP_SECONDS = 0.001


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--regions", type=int, required=True)
    parser.add_argument("--region-bytes", type=int, required=True)
    parser.add_argument("--name", default="bench-raw-target")
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    api = load_nixl()
    agents: list[Any] = []
    regions: list[list[torch.Tensor]] = []
    registrations: list[Any] = []
    for rank in range(args.ranks):
        agent = api.nixl_agent(f"{args.name}-r{rank}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        # Written, not just allocated: a READ of never-touched pages would copy the zero page.
        tensors = [
            region_buffer(args.region_bytes, args.device, rank, huge_pages=args.huge_pages == "on").fill_(rank + 1)
            for _ in range(args.regions)
        ]
        registrations.append(agent.register_memory(tensors))
        agents.append(agent)
        regions.append(tensors)
    ranks = [
        {
            "name": f"{args.name}-r{rank}",
            "metadata": bytes(agent.get_agent_metadata()).hex(),
            "bases": [t.data_ptr() for t in regions[rank]],
        }
        for rank, agent in enumerate(agents)
    ]
    sys.stdout.write(json.dumps({"ranks": ranks}) + "\n")
    sys.stdout.flush()
    commands: queue.Queue[str] = queue.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("quit")

    threading.Thread(target=read_commands, daemon=True).start()
    value = 1
    while True:
        try:
            command = commands.get(timeout=PUMP_SECONDS)
        except queue.Empty:
            command = ""
        if command == "quit":
            break
        word, *rest = command.split() or [""]
        if word in ("rewrite", "serve"):
            value = value % 250 + 1
            for tensors in regions:
                for t in tensors:
                    t.fill_(value)
            if args.device == "cuda":
                torch.cuda.synchronize()  # written before the READ is posted, as prefill's state is
            sys.stdout.write("ok\n")
            sys.stdout.flush()
        if word == "serve":
            pumping, count, tag = rest
            _serve(agents, pause(pumping), int(count), bytes.fromhex(tag), commands)
        for agent in agents:
            agent.get_new_notifs()
    for agent, reg in zip(agents, registrations):
        agent.deregister_memory(reg)
    return 0


def _serve(agents: list[Any], pause_: Callable[[], None], count: int, tag: bytes, commands: queue.Queue[str]) -> None:
    """Pump every agent, `pause_()` between rounds, until `count` notifications `tag` arrived."""
    seen = 0
    while seen < count and commands.empty():
        for agent in agents:
            for messages in agent.get_new_notifs().values():
                seen += messages.count(tag)
        pause_()


if __name__ == "__main__":
    sys.exit(main())
