"""DecodeService handlers: thin proto <-> domain adapters, the request's end reported once
(`Stage.REQUEST`: its metrics count it, the tracer ends its span), and the one log line per
finished request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from decode_svc.generation import Generation
from decode_svc.learned_peers import LearnedPeers
from decode_svc.local_prefill import LocalPrefillMode
from decode_svc.prefill_peer import PrefillPeers
from decode_svc.request import validate
from shared.config import DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS, DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_READ_TIMEOUT_SECONDS
from shared.errors import ServiceError
from shared.logs import context as log_context
from shared.observe import ERROR_MESSAGE, FAILURE_REASON, STATUS, TOKENS, TRANSFER_BYTES, TRANSFER_READS, Observer, Stage
from shared.otel import spans
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.lifecycle import Lifecycle
from shared.rpc.proto_time import seconds
from shared.runtime.engine_host import EngineHost
from shared.runtime.metrics import ServiceMetrics

log = logging.getLogger(__name__)
# A cancellation this close to the client's deadline is the deadline (gRPC cancels the handler
# when it passes; our own clock read at the start of the call runs a little ahead of it).
DEADLINE_SLACK_SECONDS = 0.05


@dataclass
class EarlyStop:
    """Set `stopped` before closing `generate()` when the output is complete (not a cancel)."""

    stopped: bool = False


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(
        self,
        host: EngineHost,
        peers: PrefillPeers,
        lifecycle: Lifecycle,
        *,
        check_state: bool,
        read_timeout: float = DEFAULT_READ_TIMEOUT_SECONDS,
        manifest_parts: bool = True,
        metrics: ServiceMetrics | None = None,
        learned: LearnedPeers | None = None,
        prefix_cache_blocks: int = 0,
        prefix_cache_states: int = 0,
        local_prefill: LocalPrefillMode = "fallback",
        local_prefill_below: int = 0,
        local_prefill_queue_tokens: int = DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS,
        stream_interval: int = 1,
        max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
    ) -> None:
        self.host = host
        self.stream_interval = stream_interval  # --stream-interval: every request's streams coalesce this many tokens
        self.peers = peers
        self.lifecycle = lifecycle
        self.metrics = metrics or ServiceMetrics("decode")
        self.observer = Observer(self.metrics.telemetry)
        self.generation = Generation(
            host,
            peers,
            check_state=check_state,
            read_timeout=read_timeout,
            manifest_parts=manifest_parts,
            telemetry=self.metrics.telemetry,
            learned=learned,
            prefix_cache_blocks=prefix_cache_blocks,
            prefix_cache_states=prefix_cache_states,
            local_prefill=local_prefill,
            local_prefill_below=local_prefill_below,
            local_prefill_queue_tokens=local_prefill_queue_tokens,
            max_batched_tokens=max_batched_tokens,
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        # aclosing: a call cancelled while this handler waits at its yield ends the generation now.
        parent = spans.grpc_parent(context)  # the caller's traceparent, if it sent one
        responses = self.generate(request, context.time_remaining(), peer=context.peer(), trace_parent=parent, from_grpc=True)
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    async def generate(
        self,
        request: pb.GenerateRequest,
        time_remaining: float | None,
        early_stop: EarlyStop | None = None,
        *,
        peer: str = "",
        trace_parent: Context | None = None,
        from_grpc: bool = False,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The one entry both front doors (gRPC Generate and the HTTP API) call: refused while
        draining, counted by final status, logged once when it ends. A consumer that closes this
        generator early counts as CANCELLED, unless it set `early_stop.stopped` first (an HTTP
        stop sequence matched), or as DEADLINE_EXCEEDED once the client's deadline has passed.
        Traced as one span (the current span's child unless `trace_parent` names another)."""
        if not request.request_id:
            request.request_id = uuid.uuid4().hex  # named here, so every log line of the request carries it
        log_context.bind_request(request.request_id, peer)
        span = _start_span(request, trace_parent, from_grpc)
        within = None if span is None else trace.set_span_in_context(span)  # where the request's end is reported
        loop = asyncio.get_running_loop()
        deadline = None if time_remaining is None else loop.time() + time_remaining
        status, message, reason = "INTERNAL", "", ""
        summary: pb.GenerateSummary | None = None
        observer = self.observer
        started = last_token = loop.time()
        tokens_seen = False
        try:
            self.lifecycle.check_accepting("new requests")
            context = validate(self.host, request, time_remaining)  # the request once, as domain values
            context = dataclasses.replace(context, stream_interval=self.stream_interval)
            with self.lifecycle.track():
                async for response in spans.within(span, self.generation.run(context)):
                    if response.HasField("summary"):
                        summary = response.summary
                    elif n := len(response.chunk.token_ids):
                        now = loop.time()
                        if tokens_seen:  # the first chunk's wait is the TTFT, not a gap
                            observer.stage(Stage.TOKENS, now - last_token, {TOKENS: n})
                        tokens_seen, last_token = True, now
                    yield response
            status = "OK"
        except GeneratorExit:
            status = "OK" if early_stop is not None and early_stop.stopped else self._cut_status(deadline)
            raise
        except ServiceError as e:
            status, message = e.status, e.message
            if e.reason != e.default_reason:
                reason = e.reason
            raise
        except asyncio.CancelledError:
            if self.lifecycle.past_grace:  # cut by the end of the drain: say so, not "Cancelling all calls"
                error = self.lifecycle.grace_ended_error()
                status, message, reason = error.status, error.message, error.reason
                raise error from None
            status = self._cut_status(deadline)  # the client went away, or its deadline passed
            raise
        finally:
            _log_finished(request, status, message, summary)
            ended = _end_attributes(status, reason, message, summary)
            observer.stage(Stage.REQUEST, loop.time() - started, ended, within=within)

    def _cut_status(self, deadline: float | None) -> str:
        if deadline is not None and asyncio.get_running_loop().time() >= deadline - DEADLINE_SLACK_SECONDS:
            return "DEADLINE_EXCEEDED"
        if self.lifecycle.past_grace:
            return "UNAVAILABLE"
        return "CANCELLED"

    async def GetLayout(self, request: pb.GetLayoutRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.GetLayoutResponse:
        learned = self.generation.learned.peers.values()
        return pb.GetLayoutResponse(layout=self.host.message, peers=[p.status() for p in [*self.peers.peers, *learned]])


def _start_span(request: pb.GenerateRequest, parent: Context | None, from_grpc: bool) -> Span | None:
    if not spans.enabled():
        return None
    attributes: dict[str, AttributeValue] = {
        "hybrid_pd.request_id": request.request_id,
        "hybrid_pd.max_tokens": request.max_tokens,
    }
    if request.prompt_token_ids:
        attributes["hybrid_pd.prompt_tokens"] = len(request.prompt_token_ids)
    if from_grpc:  # the server span; under HTTP, the HTTP request's span is
        attributes.update({"rpc.system": "grpc", "rpc.service": "hybridpd.v1.DecodeService", "rpc.method": "Generate"})
    kind = SpanKind.SERVER if from_grpc else SpanKind.INTERNAL
    return spans.start(spans.GENERATE, kind=kind, parent=parent, attributes=attributes)


def _end_attributes(status: str, reason: str, message: str, summary: pb.GenerateSummary | None) -> dict[str, AttributeValue]:
    """What the request's end reports: how it ended, and what its summary said (for its span)."""
    attributes: dict[str, AttributeValue] = {STATUS: status}
    if reason:
        attributes[FAILURE_REASON] = reason
    if message:
        attributes[ERROR_MESSAGE] = message
    if summary is not None:
        attributes.update({
            "hybrid_pd.prompt_tokens": summary.prompt_token_count,
            "hybrid_pd.generated_tokens": summary.generated_token_count,
            "hybrid_pd.prefill_engine_id": summary.prefill_engine_id,
            TRANSFER_BYTES: summary.transfer.total_bytes,
            TRANSFER_READS: summary.transfer.read_count,
        })  # fmt: skip
    return attributes


def _log_finished(request: pb.GenerateRequest, status: str, message: str, summary: pb.GenerateSummary | None) -> None:
    """One INFO line per finished request, failed or not, with its numbers and status (gathered
    only when the line goes anywhere: with INFO off a request pays one level check)."""
    if not log.isEnabledFor(logging.INFO):
        return
    fields: dict[str, object] = {"status": status, "prompt_tokens": len(request.prompt_token_ids) or None}
    if summary is not None:
        fields.update(
            prompt_tokens=summary.prompt_token_count,
            generated_tokens=summary.generated_token_count,
            bytes_moved=summary.transfer.total_bytes,
            reads=summary.transfer.read_count,
            read_ms=round(seconds(summary.read_duration) * 1e3, 3),
            prefill_ms=round(seconds(summary.prefill_duration) * 1e3, 3),
            ttft_ms=round(seconds(summary.time_to_first_token) * 1e3, 3),
            total_ms=round(seconds(summary.total_duration) * 1e3, 3),
            prefill=summary.prefill_engine_id,
        )
    if message:
        fields["error"] = message
    fields = {k: v for k, v in fields.items() if v is not None}
    log.info("request %s finished: %s", request.request_id, status, extra={"fields": fields})
