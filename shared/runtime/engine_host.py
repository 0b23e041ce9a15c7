"""The ranks of one engine living in this service process, and what a peer learns about them.

An `EngineHost` owns, for `--tp N` ranks: the layout (pure math), one `RankCache` and one
NIXL `RankAgent` per rank (memory registered once at start), the single completion poller,
the block allocator (one for the engine: a request's block ids are the same on every rank),
and the model engine that reads and writes state in those blocks. Both services build one;
the handshake message (`message`) is derived from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from shared import observe
from shared.cache.allocator import BlockAllocator, BlocksExhausted
from shared.cache.cache_size import cache_blocks, capacity_line, memory_limit
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.config import ServiceSettings
from shared.engine.protocol import Engine, RequestBlocks, WarmsUp
from shared.engine.vocabulary import check_token_ids
from shared.errors import InvalidArgument, ResourceExhausted
from shared.layout.models import load_model
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.spec import LayoutError, ModelSpec
from shared.observe import Observer, Stage, Step
from shared.pb.hybridpd.v1 import layout_pb2 as pb
from shared.runtime.block_line import BlockLine, Claim
from shared.runtime.compute_thread import ComputeThread
from shared.runtime.layout_message import RankMemory, engine_layout_message
from shared.timeouts import within
from shared.transport.agent import RankAgent
from shared.transport.loopback import loopback_read
from shared.transport.notifications import UnknownHandler
from shared.transport.poller import CompletionPoller

log = logging.getLogger(__name__)
T = TypeVar("T")


def _runs(ids: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """`ids` cut into consecutive runs of `counts` (views: no small arrays built per group)."""
    runs, start = [], 0
    for n in counts:
        runs.append(ids[start : start + n])
        start += n
    return runs


EngineFactory = Callable[[EngineLayout, Sequence[RankCache]], Engine]
"""Builds the model engine over the host's layout and per-rank caches (`--engine`)."""


async def _until_set(event: asyncio.Event, timeout: float) -> None:
    """Wait for `event` at most `timeout` seconds; the caller looks again either way (`within`:
    a cancel that comes as the event is set still cancels)."""
    with contextlib.suppress(TimeoutError):
        await within(event.wait(), timeout)


def new_incarnation() -> int:
    """Random, non-zero: tells a restarted engine (new memory) from the one a peer knew."""
    return secrets.randbits(63) | 1


def layout_for(settings: ServiceSettings) -> EngineLayout:
    """The layout `settings` give (model, TP, block sizes, dtypes); bad values name their flag."""
    try:
        if settings.engine in ("hf", "paged"):
            # Lossless state dtypes and the checkpoint's identity (config content + weights).
            from shared.engine.hf.model_spec import hf_model_spec

            spec = hf_model_spec(
                settings.model,
                dtype=settings.dtype,
                kv_dtype=settings.kv_dtype,
                conv_dtype=settings.conv_dtype,
                ssm_dtype=settings.ssm_dtype,
            )
        else:
            spec = load_model(
                settings.model, kv_dtype=settings.kv_dtype, conv_dtype=settings.conv_dtype, ssm_dtype=settings.ssm_dtype
            )
    except LayoutError as e:  # CheckpointError is one too
        raise InvalidArgument(str(e), field="--model") from e
    try:
        return build_engine_layout(
            spec, settings.tp, block_size=settings.block_size, kernel_block_size=settings.kernel_block_size
        )
    except LayoutError as e:
        raise InvalidArgument(f"--tp/--block-size/--kernel-block-size do not fit model {spec.name}: {e}") from e


def engine_line(settings: ServiceSettings, model_name: str) -> tuple[int, str]:
    """(log level, line) saying which engine serves and why; a synthetic engine nobody asked for
    is a WARNING: its tokens are byte patterns, not a model's. --batch-invariant off is said too,
    and the paged engine's compute threads for the role."""
    why = " (chosen by --model; --engine overrides)" if settings.engine_from_model else ""
    level = logging.INFO
    if settings.engine == "synthetic":
        text = (
            f"engine synthetic{why}: serves verifiable byte patterns at the real sizes of {model_name}, not model "
            "outputs; --engine hf --model DIR runs a checkpoint"
        )
        level = logging.WARNING if settings.engine_from_model else logging.INFO
    elif settings.engine == "reference":
        text = f"engine reference{why}: the tiny seeded model {model_name}"
    else:
        text = f"engine {settings.engine}{why}: checkpoint {settings.model}"
    return level, text + _invariance(settings) + _threads(settings) + _kernels(settings)


def _threads(settings: ServiceSettings) -> str:
    """The paged engine's threads for this service's steps (each role takes only its own flag; the
    other engines compute on one thread, so nothing is said)."""
    if settings.engine != "paged":
        return ""
    if settings.role == "decode":
        return f"; decode threads {settings.decode_threads}"
    return f"; prefill threads {settings.prefill_threads}"


def _kernels(settings: ServiceSettings) -> str:
    """Which path a paged decode step's Mamba2 conv and state updates and attention take (the C
    kernels are built here, once per machine)."""
    if settings.engine != "paged" or settings.role != "decode":
        return ""
    if not settings.native_kernels:
        return "; decode kernels: torch path (--native-kernels off)"
    from shared.engine.paged.attention_kernel import attention_kernel
    from shared.engine.paged.conv_kernel import conv_step_kernel
    from shared.engine.paged.mamba2_kernel import mamba2_state_kernel

    if conv_step_kernel() is None or mamba2_state_kernel() is None or attention_kernel() is None:
        return "; decode kernels: torch path (a C kernel did not build: see the log)"
    return "; decode kernels: C (Mamba2 conv and state updates, attention; fp32 models on a CPU)"


def _invariance(settings: ServiceSettings) -> str:
    """What --batch-invariant off changes, said where the engine is named (on is the default: nothing)."""
    if settings.batch_invariant:
        return ""
    if settings.engine == "paged":
        return "; batch invariance off: one GEMM over each step's batch, a request's bits depend on what shares its step"
    return f"; --batch-invariant off is ignored: the {settings.engine} engine does not batch"


@dataclass
class EngineHost:
    role: str
    engine_id: str
    incarnation: int
    spec: ModelSpec
    layout: EngineLayout
    num_blocks: int
    device: str
    caches: list[RankCache]
    agents: list[RankAgent]
    poller: CompletionPoller
    allocator: BlockAllocator
    engine: Engine
    message: pb.EngineLayout
    verify_transfer: bool = True  # --verify-transfer digest: prefill takes digests, decode checks them
    # Model compute is synchronous and CPU/GPU-bound: one thread, never the event loop, with its
    # torch thread count set before its first op (compute_threads).
    compute: ComputeThread = field(default_factory=lambda: ComputeThread("engine"))
    # Prefill's digests of a manifest part, taken while the compute thread goes on to the next
    # chunk (a host cache: the hash releases the GIL, so it runs beside the model). Started at
    # its first call: a decode host never starts it.
    digest_thread: ComputeThread = field(default_factory=lambda: ComputeThread("digest"))
    # Set (and replaced) whenever blocks are freed: running requests waiting to grow wake up.
    _freed: asyncio.Event = field(default_factory=asyncio.Event)
    # Requests and jobs waiting for blocks to start, in the order they came (block_line says how).
    line: BlockLine = field(default_factory=BlockLine)
    observer: Observer = field(default_factory=Observer)  # each allocate_queued's wait (Stage.QUEUE_WAIT)
    waiting_for_blocks: int = 0  # requests and jobs waiting for free blocks now: to start, or to grow (metrics)
    views: list[RankViews] = field(init=False)  # typed views of every rank's cache (digests)
    # Decode's prefix cache and state checkpoints: free up to n of the blocks they keep (least
    # recently used, none in use) when an allocation finds too few free; returns how many freed.
    reclaim: Callable[[int], int] | None = None
    # Called once when a holder's blocks are freed (`when_freed`): prefill's boundary cache
    # unpins the boundaries a job borrowed blocks from.
    _on_free: dict[str, list[Callable[[], None]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.views = [RankViews(self.layout, cache) for cache in self.caches]

    @classmethod
    async def start(
        cls, settings: ServiceSettings, engine_factory: EngineFactory, *, on_unknown_notif: UnknownHandler | None = None
    ) -> EngineHost:
        """Layout, caches, agents (memory registered once), a loopback self-READ per rank, poller
        and engine for `settings`. `on_unknown_notif` sees notifications nobody waits for."""
        layout = layout_for(settings)
        spec = layout.spec
        log.log(*engine_line(settings, spec.name))
        if layout.block_size_raised:
            log.warning("block size %s is below the minimum for this model: using %s", settings.block_size, layout.block_size)
        limit = await asyncio.to_thread(memory_limit, settings.device, settings.tp)
        num_blocks = cache_blocks(layout, settings.num_blocks, settings.memory_budget, limit)
        incarnation = new_incarnation()
        devices = [f"cuda:{r}" if settings.device == "cuda" else "cpu" for r in range(settings.tp)]
        caches = await asyncio.to_thread(
            lambda: [
                RankCache(layout.num_regions, num_blocks, layout.page_bytes, d, huge_pages=settings.huge_pages) for d in devices
            ]
        )
        agents: list[RankAgent] = []
        poller = CompletionPoller(on_unknown_notif=on_unknown_notif)
        try:
            for rank in range(settings.tp):
                agent = await RankAgent.create(settings.engine_id, rank, incarnation=f"{incarnation:016x}"[-8:])
                agents.append(agent)
                await caches[rank].register(agent)
                poller.attach(agent)
                moved = await loopback_read(agent, caches[rank], poller)
                log.info("rank %d: agent %s up, memory registered, loopback READ of %d B ok", rank, agent.name, moved)
            ranks = [
                RankMemory(
                    agent_name=agent.name,
                    agent_metadata=await agent.metadata(),
                    device_type=settings.device,
                    device_id=cache.place.device_id,
                    region_base_addresses=tuple(int(a) for a in cache.base_addresses()),
                )
                for agent, cache in zip(agents, caches)
            ]
            # Off the event loop: loading a checkpoint takes seconds the loop must keep serving.
            engine = await asyncio.to_thread(engine_factory, layout, caches)
        except BaseException:
            await poller.aclose()
            for agent in agents:
                await agent.aclose()
            raise
        message = engine_layout_message(
            layout,
            role=settings.role,
            engine_id=settings.engine_id,
            incarnation=incarnation,
            num_logical_blocks=num_blocks,
            ranks=ranks,
            boundary=engine.boundary,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,  # 0 on decode (a prefill-only flag)
        )
        host = cls(
            role=settings.role,
            engine_id=settings.engine_id,
            incarnation=incarnation,
            spec=spec,
            layout=layout,
            num_blocks=num_blocks,
            device=settings.device,
            caches=caches,
            agents=agents,
            poller=poller,
            allocator=BlockAllocator(num_blocks),
            engine=engine,
            message=message,
            verify_transfer=settings.verify_transfer,
        )
        if isinstance(engine, WarmsUp):
            try:
                await host.warm_up(engine)
            except BaseException:
                await host.aclose()
                raise
        sized = "" if settings.num_blocks or settings.memory_budget else " (default size: see --num-blocks in --help)"
        log.info(
            "%s engine %s: model %s, tp %d on %s; %s%s",
            settings.role, settings.engine_id, spec.name, settings.tp, settings.device,
            capacity_line(layout, num_blocks, host.max_tokens()), sized,
        )  # fmt: skip
        return host

    async def warm_up(self, engine: WarmsUp) -> None:
        """The engine's once-per-weight work (WarmsUp) on the compute thread, before the service
        takes requests, in scratch blocks freed after; skipped (said) if the cache cannot hold them."""
        key = "engine-warm-up"
        try:
            blocks = self.allocate(key, engine.warm_up_tokens + 1)
        except ResourceExhausted:
            log.info("engine warm-up skipped: the cache has no room for %d tokens", engine.warm_up_tokens + 1)
            return
        began = time.monotonic()
        try:
            await self.submit_compute(functools.partial(engine.warm_up, blocks))
        finally:
            self.free(key)
        log.info("engine warmed up in %.2f s (a short prompt and a decode step)", time.monotonic() - began)

    # ---- blocks ----

    def blocks_per_group(self, num_tokens: int) -> list[int]:
        """Logical blocks each group needs for `num_tokens` tokens (Mamba groups: always 1)."""
        return self.layout.blocks_per_group(num_tokens)

    def check_token_ids(self, prompt: Sequence[int] | npt.NDArray[np.int64], field: str) -> None:
        """InvalidArgument naming `field` when a token id is outside the model's vocabulary."""
        check_token_ids(prompt, self.spec.vocab_size, field)

    def max_tokens(self) -> int:
        """The most tokens one request can hold if it had the whole cache."""
        fa_groups = len(self.layout.attention_group_ids)
        spare = self.num_blocks - len(self.layout.mamba_group_ids)
        return max(0, spare // max(1, fa_groups)) * self.layout.block_size

    def allocate(
        self,
        key: str,
        num_tokens: int,
        *,
        leading: Sequence[np.ndarray] | None = None,
        claim: Claim = Claim.NEWCOMER,
    ) -> RequestBlocks:
        """Blocks for a request's first `num_tokens` tokens, split per group (one allocation).
        `leading`: per group, blocks the request uses first without holding them (decode's
        prefix cache); only the rest are allocated. `claim`: which free blocks it may take."""
        counts = self.blocks_per_group(num_tokens)
        if leading is None:  # nothing to join: each group's blocks are a run of the one fresh array
            return RequestBlocks(key, _runs(self.take(key, sum(counts), claim), counts))
        given = [np.asarray(b, dtype=np.int64) for b in leading]
        counts = [max(0, n - len(b)) for n, b in zip(counts, given)]
        ids = self.take(key, sum(counts), claim)
        return RequestBlocks(key, [np.concatenate([first, rest]) for first, rest in zip(given, _runs(ids, counts))])

    def take(self, key: str, n: int, claim: Claim = Claim.RUNNING) -> np.ndarray:
        """`n` more blocks for `key`, of those `claim` may take (`BlockLine`); decode's caches
        give up blocks first if too few are (not for a newcomer behind a line: what they gave
        up would go to the line)."""
        short = n - self.line.usable(claim, self.allocator.num_free)
        if short > 0 and self.reclaim is not None and not (claim is Claim.NEWCOMER and self.line):
            self.reclaim(short)
        free = self.allocator.num_free
        usable = self.line.usable(claim, free)
        if n > usable and usable < free:  # the rest are set aside for requests that waited first
            raise ResourceExhausted(
                f"cache full for new requests: {n} blocks requested, {free} free, all but {usable} of them set "
                f"aside for the {len(self.line)} requests waiting for blocks before this one",
                reason="CACHE_FULL",
            )
        try:
            ids = self.allocator.allocate(key, n)
        except BlocksExhausted as e:
            raise ResourceExhausted(str(e), reason="CACHE_FULL") from e
        self.line.taken(claim, n, self.allocator.num_free)
        return ids

    def grow(self, blocks: RequestBlocks, num_tokens: int) -> RequestBlocks:
        """Add attention blocks so `num_tokens` tokens fit (decode, as the sequence grows)."""
        need = self.blocks_per_group(num_tokens)
        extra = [
            max(0, n - len(have)) if g.kind == "attention" else 0
            for n, have, g in zip(need, blocks.block_ids, self.layout.groups)
        ]
        if not any(extra):
            return blocks
        ids = self.take(blocks.request_id, sum(extra))
        return RequestBlocks(
            blocks.request_id, [np.concatenate([have, more]) for have, more in zip(blocks.block_ids, _runs(ids, extra))]
        )

    def when_freed(self, key: str, fn: Callable[[], None]) -> None:
        """Call `fn` once, when `free(key)` is first called after this."""
        self._on_free.setdefault(key, []).append(fn)

    def free(self, key: str) -> int:
        freed = self.allocator.free(key)
        for fn in self._on_free.pop(key, ()):
            fn()
        if freed:
            self.line.freed(freed, self.allocator.num_free)
            self._freed.set()
            self._freed = asyncio.Event()
        return freed

    async def allocate_queued(
        self,
        key: str,
        num_tokens: int,
        deadline: float,
        *,
        counted: bool = True,
        leading: Sequence[np.ndarray] | None = None,
        running: bool = False,
    ) -> RequestBlocks:
        """`allocate`, but while the cache is full wait for frees until `deadline` (event-loop
        time), then raise RESOURCE_EXHAUSTED. A request that could never fit fails at once.
        Waiters get blocks in the order they came (`BlockLine`); `running`: blocks for a request
        that holds some already (a fork), which takes any free block and waits in no line.
        `counted`: the wait is reported (requests and jobs; not start-up probes)."""
        loop = asyncio.get_running_loop()
        started = loop.time()

        def attempt(claim: Claim) -> RequestBlocks:
            return self.allocate(key, num_tokens, leading=leading, claim=claim)

        if running:
            blocks = await self._when_free(lambda: attempt(Claim.RUNNING), num_tokens, deadline, counted=counted)
        else:
            try:
                blocks = attempt(Claim.NEWCOMER)
            except ResourceExhausted as e:
                self._check_can_wait(e, deadline, num_tokens)
                blocks = await self._in_line(lambda: attempt(Claim.FIRST_IN_LINE), deadline, counted)
        if counted:  # also the breakdown's p.allocated step (END_STEPS)
            self.observer.stage(Stage.QUEUE_WAIT, loop.time() - started)
        return blocks

    async def _in_line(self, attempt: Callable[[], RequestBlocks], deadline: float, counted: bool) -> RequestBlocks:
        """Wait at the end of the line; `attempt()` once first in it, at every free, until it finds
        the blocks or `deadline` passes (RESOURCE_EXHAUSTED). Leaving, on any outcome, passes the
        turn on."""
        loop = asyncio.get_running_loop()
        turn = self.line.join()
        if counted:
            self.waiting_for_blocks += 1
        try:
            while True:
                if self.line.first(turn):
                    try:
                        return attempt()
                    except ResourceExhausted as e:
                        self._check_can_wait(e, deadline)
                turn.clear()
                await _until_set(turn, deadline - loop.time())
                if loop.time() >= deadline and not self.line.first(turn):
                    raise ResourceExhausted(
                        f"the cache is full and {len(self.line) - 1} requests wait for blocks; still waiting "
                        "behind earlier ones when the request's deadline came",
                        reason="CACHE_FULL",
                    )
        finally:
            self.line.leave(turn)
            if counted:
                self.waiting_for_blocks -= 1

    def _check_can_wait(self, e: ResourceExhausted, deadline: float, num_tokens: int = 0) -> None:
        """Raise `e` as final when waiting cannot help: the deadline came, or `num_tokens` need
        more blocks than the whole cache."""
        if deadline - asyncio.get_running_loop().time() <= 0 or sum(self.blocks_per_group(num_tokens)) > self.num_blocks:
            raise ResourceExhausted(f"{e.message}; still full when the request's deadline came", reason="CACHE_FULL")

    async def grow_queued(self, blocks: RequestBlocks, num_tokens: int, deadline: float) -> RequestBlocks:
        """`grow`, but while the cache is full wait for frees until `deadline` (event-loop time),
        then raise RESOURCE_EXHAUSTED. Decode, as a sequence crosses a block boundary."""
        return await self._when_free(lambda: self.grow(blocks, num_tokens), num_tokens, deadline)

    async def _when_free(
        self, attempt: Callable[[], RequestBlocks], num_tokens: int, deadline: float, *, counted: bool = True
    ) -> RequestBlocks:
        """`attempt()` until it finds the blocks, waking at every free; RESOURCE_EXHAUSTED once
        `deadline` passes, or at once when `num_tokens` need more blocks than the whole cache. While
        it waits the caller counts in `waiting_for_blocks` (`counted`)."""
        loop = asyncio.get_running_loop()
        waiting = False
        try:
            while True:
                try:
                    return attempt()
                except ResourceExhausted as e:
                    left = deadline - loop.time()
                    # Counted only when full: the common first attempt succeeds without it.
                    if left <= 0 or sum(self.blocks_per_group(num_tokens)) > self.num_blocks:
                        raise ResourceExhausted(
                            f"{e.message}; still full when the request's deadline came", reason="CACHE_FULL"
                        ) from None
                    if counted and not waiting:
                        waiting = True
                        self.waiting_for_blocks += 1
                    await _until_set(self._freed, left)
        finally:
            if waiting:
                self.waiting_for_blocks -= 1

    # ---- compute ----

    async def run_compute(self, fn: Callable[[], T]) -> T:
        """Run model code on the compute thread and await it from the loop."""

        def call() -> T:
            observe.mark(Step.COMPUTE)
            return fn()

        result = await self.compute.submit(call)
        observe.mark(Step.COMPUTED)
        return result

    def submit_compute(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue model code on the compute thread now (`run_compute` queues it only once the
        awaiting task first runs) and return its future."""

        def call() -> T:
            observe.mark(Step.COMPUTE)
            return fn()

        return self.compute.submit(call)

    async def aclose(self) -> None:
        await self.poller.aclose()
        for agent in self.agents:
            await agent.aclose()
        self.compute.shutdown(wait=False)
        self.digest_thread.shutdown(wait=False)


def engine_factory_for(kind: str, settings: ServiceSettings | None = None) -> EngineFactory:
    """The model engine behind `--engine` (synthetic, reference, hf or paged), over typed views of
    each rank's cache. The hf and paged engines read their checkpoint directory, dtype and device
    from `settings`."""
    from shared.engine.factory import make_engine

    def factory(layout: EngineLayout, caches: Sequence[RankCache]) -> Engine:
        views = [RankViews(layout, cache) for cache in caches]
        try:
            if settings is None:
                return make_engine(kind, layout, views)
            return make_engine(
                kind,
                layout,
                views,
                model_dir=settings.model,
                dtype=settings.dtype,
                device=settings.device,
                boundary=settings.boundary,
                prefill_chunk_tokens=settings.prefill_chunk_tokens,
                batch_invariant=settings.batch_invariant,
                decode_threads=settings.decode_threads,
                native_kernels=settings.native_kernels,
                prefill_threads=settings.prefill_threads,
            )
        except ValueError as e:
            raise InvalidArgument(str(e), field="engine") from e

    return factory
