"""The raw NIXL baselines: plain agents reading the same bytes the services move.

(a) identical descriptors: the same read lists and the same descriptor ids as the decode
    service (rebuilt from the layout math over this process's own memory), one prepared READ
    per (decode rank, prefill rank), carrying a notification as ours do;
(b) one descriptor per region: for every pair and region, the bytes (a) moves from that region
    as one contiguous descriptor (the fewest descriptors those bytes can take).

Like the decode service, each decode rank has its own agent, and the READs of different
decode ranks run at the same time (one thread per rank; NIXL releases the GIL during the copy).
A timed round is exactly make_prepped_xfer + transfer (+ polls until DONE) + release.

While a READ is in flight both sides progress UCX as a pumping strategy says (raw_pumping.py):
the reader between its polls, the target (`RawTarget.serve`) from just before the READ is
posted until its notification arrives. Over TCP the target's pumping is what serves the READ.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from hybridpd_tools.bench.raw_memory import region_buffer
from hybridpd_tools.bench.raw_pumping import pause
from shared.cache.memory_place import MemoryPlace
from shared.layout.read_lists import IdArray
from shared.transport.memory import nixl_descs
from shared.transport.nixl_env import load_nixl

IntArray = npt.NDArray[np.int64]
START_TIMEOUT_SECONDS = 60.0


def coalesce_per_region(
    local_descs: IntArray,
    local_idx: IdArray,
    local_bases: IntArray,
    remote_bases: IntArray,
) -> tuple[IntArray, IntArray]:
    """(local, remote) Nx2 lists with one descriptor per region, moving as many bytes from each
    region as the selected descriptors do: region j's bytes start at each side's base j."""
    addrs = local_descs[local_idx, 0]
    lengths = local_descs[local_idx, 1]
    order = np.argsort(local_bases)
    region = order[np.searchsorted(local_bases[order], addrs, side="right") - 1]
    per_region = np.bincount(region, weights=lengths, minlength=len(local_bases)).astype(np.int64)
    used = np.flatnonzero(per_region)
    local = np.stack([local_bases[used], per_region[used]], axis=1).astype(np.int64)
    remote = np.stack([remote_bases[used], per_region[used]], axis=1).astype(np.int64)
    return local, remote


@dataclass(frozen=True)
class TargetRank:
    name: str
    metadata: bytes
    bases: IntArray


class RawTarget:
    """The raw_target process: P plain agents with R regions of `region_bytes` each."""

    def __init__(
        self,
        ranks: int,
        regions: int,
        region_bytes: int,
        name: str = "bench-raw-target",
        *,
        huge_pages: bool = True,
        device: str = "cpu",
        launch: Sequence[str] = (),
    ) -> None:
        cmd = [
            *launch, sys.executable, "-m", "hybridpd_tools.bench.raw_target",
            "--ranks", str(ranks), "--regions", str(regions), "--region-bytes", str(region_bytes), "--name", name,
            "--huge-pages", "on" if huge_pages else "off", "--device", device,
        ]  # fmt: skip
        self.place = [MemoryPlace("VRAM", r) if device == "cuda" else MemoryPlace("DRAM", 0) for r in range(ranks)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(START_TIMEOUT_SECONDS)
            raise RuntimeError(f"the raw NIXL target exited with code {self.proc.returncode} before describing itself")
        info = json.loads(line)
        self.ranks = [
            TargetRank(r["name"], bytes.fromhex(r["metadata"]), np.asarray(r["bases"], dtype=np.int64)) for r in info["ranks"]
        ]

    def rewrite(self) -> None:
        """Have the target write new bytes into every region (as prefill does before a READ)."""
        self._ask("rewrite")

    def serve(self, pumping: str, notif: bytes, count: int) -> None:
        """Rewrite every region, then have the target pump as `pumping` says until `count`
        notifications `notif` arrive (the READs about to be posted); returns once it pumps."""
        pause(pumping)  # an unknown name fails here, not in the target
        self._ask(f"serve {pumping} {count} {notif.hex()}")

    def _ask(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if answer != "ok":
            word = line.split()[0]
            raise RuntimeError(f"the raw NIXL target answered {answer!r} to {word} (exit code {self.proc.poll()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class PreparedRead:
    """One (decode rank, prefill rank) READ, prepared: dlist handles and int32 ids."""

    decode_rank: int
    remote_name: str
    local_handle: Any
    remote_handle: Any
    local_idx: npt.NDArray[np.int32]
    remote_idx: npt.NDArray[np.int32]
    nbytes: int
    descriptors: int


class RawReader:
    """One plain agent per decode rank, each with R registered regions of `region_bytes`."""

    def __init__(
        self,
        target: RawTarget,
        ranks: int,
        regions: int,
        region_bytes: int,
        name: str = "bench-raw-reader",
        *,
        huge_pages: bool = True,
        device: str = "cpu",
    ) -> None:
        api = load_nixl()
        self.agents: list[Any] = []
        self.tensors: list[list[torch.Tensor]] = []
        self._registrations: list[Any] = []
        self._handles: list[tuple[int, Any]] = []
        self.remote_names: list[dict[int, str]] = []
        self.places: list[MemoryPlace] = []
        self._target = target
        for rank in range(ranks):
            agent = api.nixl_agent(f"{name}-r{rank}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            # The same memory as the services' caches (host, or rank r's GPU).
            tensors = [region_buffer(region_bytes, device, rank, huge_pages=huge_pages) for _ in range(regions)]
            self.places.append(MemoryPlace.of_tensors(tensors))
            self._registrations.append(agent.register_memory(tensors))
            self.agents.append(agent)
            self.tensors.append(tensors)
            names = {}
            for p, target_rank in enumerate(target.ranks):
                added = agent.add_remote_agent(target_rank.metadata)
                names[p] = added.decode() if isinstance(added, bytes) else str(added)
            self.remote_names.append(names)
        self._pool = ThreadPoolExecutor(max(1, ranks), thread_name_prefix="raw-nixl")

    def bases(self, rank: int) -> IntArray:
        return np.array([t.data_ptr() for t in self.tensors[rank]], dtype=np.int64)

    def prepare(
        self,
        decode_rank: int,
        prefill_rank: int,
        local_descs: IntArray,
        remote_descs: IntArray,
        local_idx: IdArray,
        remote_idx: IdArray,
    ) -> PreparedRead:
        """Prepare both descriptor lists (untimed, once per peer in the services too)."""
        agent = self.agents[decode_rank]
        remote_name = self.remote_names[decode_rank][prefill_rank]
        local, remote = self.places[decode_rank], self._target.place[prefill_rank]
        local_handle = agent.prep_xfer_dlist("NIXL_INIT_AGENT", nixl_descs(local_descs, local), local.mem_type)
        remote_handle = agent.prep_xfer_dlist(remote_name, nixl_descs(remote_descs, remote), remote.mem_type)
        self._handles += [(decode_rank, local_handle), (decode_rank, remote_handle)]
        return PreparedRead(
            decode_rank,
            remote_name,
            local_handle,
            remote_handle,
            local_idx.astype(np.int32),
            remote_idx.astype(np.int32),
            int(local_descs[local_idx, 1].sum()),
            int(local_idx.size),
        )

    def run(self, reads: Sequence[PreparedRead], notif: bytes, pumping: str = "spin") -> float:
        """Post every READ (ranks in parallel, one rank's READs in order), polling each as
        `pumping` says (raw_pumping.py); seconds until all are DONE."""
        between_polls = pause(pumping)
        by_rank: dict[int, list[PreparedRead]] = {}
        for r in reads:
            by_rank.setdefault(r.decode_rank, []).append(r)
        started = time.perf_counter()
        if len(by_rank) == 1:
            self._run_rank(next(iter(by_rank.values())), notif, between_polls)
        else:
            futures = [self._pool.submit(self._run_rank, rs, notif, between_polls) for rs in by_rank.values()]
            for future in futures:
                future.result()
        return time.perf_counter() - started

    def _run_rank(self, reads: Sequence[PreparedRead], notif: bytes, between_polls: Callable[[], None]) -> None:
        for r in reads:
            agent = self.agents[r.decode_rank]
            handle = agent.make_prepped_xfer("READ", r.local_handle, r.local_idx, r.remote_handle, r.remote_idx, notif)
            state = agent.transfer(handle)
            while state == "PROC":
                between_polls()
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw READ from {r.remote_name} ended in state {state}")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for rank, handle in self._handles:
            self.agents[rank].release_dlist_handle(handle)
        for agent, reg in zip(self.agents, self._registrations):
            agent.deregister_memory(reg)
        self._handles.clear()
        self.agents.clear()
