"""Decode computing a prompt itself (--local-prefill): no job, no READ.

When no prefill engine is ready (all restarting, none configured, or none reachable), a plain
request is prefilled by decode's own engine on its compute thread instead of failing
UNAVAILABLE, so losing every prefill engine is a slowdown, not an outage (`fallback`, the
default; `off` keeps the failure). Prompts shorter than --local-prefill-below tokens are always
computed here: moving their state would cost more than computing it. With `share`, decode also
takes a prompt while the least loaded prefill engine has a long queue of prompt tokens
(`shares_load`): at the start of a burst of long prompts decode has little to step while prefill
would queue the whole burst on its own cores.
The request then decodes in the step loop like any other. Its bits are the colocated run's with
decode's own engine settings (a prefill engine computing in chunks may round a long prompt
differently), so `share` takes a prompt only from a prefill engine that computes it as decode
does (same TP size and chunks): which side computed it, a matter of load, never changes its bits.

On an engine that batches prefill (paged), the prompts computed here share batched prefill steps
(shared/runtime/prefill_loop.py, within --max-batched-tokens), as on a prefill service: a burst
of them costs a few forwards, not one each, and the compute thread takes turns between a prefill
step and a decode step. The engine's batch invariance keeps a prompt's bits those of the prompt
alone.

A P/D decode leg (kv_transfer_params naming its prefill engine) never falls back: its prefill
already computed the prompt and holds the state for it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Literal

from decode_svc.forks import fork_seeds
from decode_svc.peer_link import PeerLink
from decode_svc.read_checks import StateChecks
from decode_svc.request import RequestContext
from decode_svc.responses import ComputedHere, client_stream, prompt_response, summary
from decode_svc.reuse import Steps
from decode_svc.state_checkpoints import Compute
from shared.config import DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS, DEFAULT_MAX_BATCHED_TOKENS
from shared.engine.first_logprobs import Prefilled, prefill_with_logprobs, prefilled, start_scoring
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import BatchedPrefill, ChunkedPrefill, RequestBlocks
from shared.engine.timed import timed
from shared.observe import Count, Observer
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.runtime.engine_host import EngineHost
from shared.runtime.prefill_loop import PrefillLoop

LocalPrefillMode = Literal["fallback", "share", "off"]
Reason = Literal["no_prefill_ready", "short_prompt", "prefill_busy"]


def shares_load(peer_tokens: int, tokens_here: int, queue_tokens: int) -> bool:
    """Whether decode computes the next prompt itself instead of adding it to a prefill engine
    with `peer_tokens` prompt tokens queued: only once that engine has at least `queue_tokens`
    (a trickle of arrivals, or a queue of short prompts, stays on prefill, whose cores are
    otherwise idle, and decode's steps stay undisturbed), and only while decode has fewer prompt
    tokens to compute itself than that engine (so a burst splits about evenly between the two)."""
    return peer_tokens >= queue_tokens and tokens_here < peer_tokens


class LocalPrefill:
    def __init__(
        self,
        host: EngineHost,
        checks: StateChecks,
        mode: LocalPrefillMode,
        below: int,
        observer: Observer,
        max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
        share_queue_tokens: int = DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS,
    ) -> None:
        self.host = host
        self.checks = checks
        self.mode = mode
        self.below = below  # prompts of fewer tokens are always computed here (0: none)
        self.share_queue_tokens = share_queue_tokens  # `share`: the prefill engine's queued tokens before decode takes one
        self.observer = observer
        self._computing: dict[str, int] = {}  # requests sent here whose prompt is not computed yet: its tokens
        engine = host.engine
        self.steps: PrefillLoop | None = None  # None: the engine prefills one prompt per call
        if isinstance(engine, BatchedPrefill) and isinstance(engine, ChunkedPrefill):
            self.steps = PrefillLoop(engine, host.submit_compute, max_batched_tokens)
            self.steps.observer = observer

    async def aclose(self) -> None:
        if self.steps is not None:
            await self.steps.aclose()

    @property
    def falls_back(self) -> bool:
        """Whether a request no prefill engine is ready to take is computed here."""
        return self.mode != "off"

    def short(self, prompt_len: int) -> bool:
        return prompt_len < self.below

    def shares(self, link: PeerLink, peer_tokens: int) -> bool:
        """Whether a prompt `link`'s prefill engine would compute behind `peer_tokens` queued
        prompt tokens is computed here instead (`share`): only where its bits are the same here."""
        if self.mode != "share":
            return False
        remote, own = link.remote, self.host.message
        same_bits = remote.tp_size == own.tp_size and remote.prefill_chunk_tokens == own.prefill_chunk_tokens
        return same_bits and shares_load(peer_tokens, self.tokens_here, self.share_queue_tokens)

    @property
    def tokens_here(self) -> int:
        """The prompt tokens of the requests sent to decode's own engine whose prompt is not
        computed yet."""
        return sum(self._computing.values())

    def claim(self, request_id: str, tokens: int) -> None:
        """The request's prompt of `tokens` will be computed here: it counts against `share` until `done`."""
        self._computing[request_id] = tokens

    def done(self, request_id: str) -> None:
        """Its prompt is computed, or it ended before (idempotent)."""
        self._computing.pop(request_id, None)

    async def run(
        self, req: RequestContext, local: RequestBlocks, compute: Compute, steps: Steps, reason: Reason
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The prompt computed into the request's own blocks, then decoded; the summary last."""
        self.observer.count(Count.LOCAL_PREFILL, kind=reason)
        engine = self.host.engine
        out = client_stream(self.host, req, self.observer)
        started = time.monotonic()
        computed = engine.num_prefill_tokens(len(req.prompt))
        if self.steps is not None and computed > 0:
            done, engine_seconds = await self._in_steps(self.steps, req, local, computed, compute)
        else:
            done, engine_seconds = await compute(
                lambda: timed(
                    prefill_with_logprobs,
                    engine,
                    req.prompt,
                    local,
                    req.sampling,
                    req.logprobs,
                    req.prompt_logprobs,
                    fork_seeds(req.sampling, req.n),
                )
            )
        self.done(req.request_id)
        first = done.first
        prefill_seconds = time.monotonic() - started
        if req.prompt_logprobs is not None:
            yield prompt_response(done.prompt_logprobs, req.prompt, req.prompt_logprobs, "prompt_logprobs")
        if first is not None:  # the full-N boundary: the engine drew the first token
            yield out.chunk([first], None if done.first_logprobs is None else [done.first_logprobs])
            out.finish = req.stop.finish(first, 1)
        if out.finish is None or req.n > 1:  # the other sequences go on after a first token that ends sequence 0
            async for chunk in steps(engine.num_prefill_tokens(len(req.prompt)), out, first, (done.forks, done.fork_logprobs)):
                yield chunk
        tail = out.tail()
        if tail is not None:
            yield tail
        assert out.finish is not None
        here = ComputedHere(prefill_seconds, engine_seconds)
        yield summary(req, out, out.finish, here, self.checks, transferred=0, read=False)

    async def _in_steps(
        self, steps: PrefillLoop, req: RequestContext, local: RequestBlocks, computed: int, compute: Compute
    ) -> tuple[Prefilled, float]:
        """The prompt's first `computed` tokens in batched prefill steps beside the other prompts computed here (the
        engine's own chunks: the bits of its `prefill`), then the logprobs and forks asked for,
        drawn on the compute thread. Cancelled during a step, it ends only once the step has
        (nothing writes the blocks any more). The engine seconds are those of its steps."""
        engine = self.host.engine
        assert isinstance(engine, ChunkedPrefill)
        run = engine.start_prefill(req.prompt, local, req.sampling)
        start_scoring(run, req.prompt_logprobs)
        order, first, seconds, start = steps.arrival(), None, 0.0, 0
        for end in chunk_ends(0, computed, engine.exact_chunk_tokens or 0):
            done = await steps.compute(run, start, end, order)
            first, start = done.first_token, end
            seconds += done.step_seconds
        seeds = fork_seeds(req.sampling, req.n)
        if first is None or (req.logprobs is None and not seeds):
            return prefilled(run, first, req.sampling, None, req.prompt_logprobs, ()), seconds
        drawn = await compute(lambda: prefilled(run, first, req.sampling, req.logprobs, req.prompt_logprobs, seeds))
        return drawn, seconds
