"""What one Generate request streams back: token chunks with their text (`ClientStream`), then
the summary of where its state came from and what moving and checking it cost (`summary`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from decode_svc import tokenizer
from decode_svc.peer_link import PeerLink
from decode_svc.read_checks import StateChecks
from decode_svc.reader import ReadStats
from decode_svc.request import RequestContext
from decode_svc.request_options import finish_reason_message
from shared.cache.manifest import Manifest
from shared.engine.logprobs import TokenLogprobs
from shared.engine.stopping import FinishReason
from shared.engine.text import TextStream
from shared.observe import Observer, Stage
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc.logprobs_message import checked_prompt, logprobs_message
from shared.rpc.proto_time import duration, nanoseconds
from shared.runtime.engine_host import EngineHost


@dataclass(frozen=True)
class Transfer:
    """What the request's READ brought: from whom, the manifest it followed, and its cost."""

    link: PeerLink
    manifest: Manifest | None  # None: a state checkpoint, or a first token that ended the request
    stats: ReadStats
    prefill_seconds: float  # job sent -> manifest (or the first token) received
    restored: bool = False  # a state checkpoint: no job and no READ
    engine_seconds: float = 0.0  # without a manifest: the prefill engine's time, as its first token said


@dataclass(frozen=True)
class ComputedHere:
    """Decode computed the prompt itself (decode_svc/local_prefill.py): no peer, nothing READ."""

    prefill_seconds: float  # prefill queued and computed on decode's compute thread
    engine_seconds: float  # its engine time alone


class ClientStream:
    """What the client has been sent of one sequence: token chunks with their text, and when the
    first one left. The one place a stream coalesces tokens (--stream-interval N): a decode
    step's token (`step`) goes out at once when it is the sequence's first or its last, else it
    waits until N are held; a first token drawn elsewhere (`chunk`) goes out at once."""

    def __init__(self, text: TextStream, started: float, observer: Observer | None, index: int = 0, interval: int = 1) -> None:
        self._text = text
        self.index = index  # which of the request's sequences (0 unless it has several)
        self.forks: list[ClientStream] = []  # sequence 0's: the other sequences' streams
        self._started = started
        self._observer = observer  # None: the first token is not reported (a fork's: sequence 0's is)
        self._interval = interval  # tokens a chunk carries before it is sent (the first token: alone)
        self._held: list[int] = []  # step tokens not sent yet
        self._held_logprobs: list[TokenLogprobs] = []
        self.generated = 0  # tokens taken, sent or held
        self.first_token_at: float | None = None
        # The decode engine's seconds for the request's first token, when decode computed it.
        self.first_step_seconds = 0.0
        self.finish: FinishReason | None = None  # set by the step that ends the request

    def chunk(self, ids: list[int], logprobs: list[TokenLogprobs] | None = None) -> pb.GenerateResponse:
        """`ids` with their text, and their logprobs (one each) when the request asked, sent now."""
        self.generated += len(ids)
        self._held += ids
        self._held_logprobs += logprobs or []
        response = self.flush()
        assert response is not None
        return response

    def step(self, token_id: int, logprobs: TokenLogprobs | None, finish: FinishReason | None) -> pb.GenerateResponse | None:
        """A decode step's token (`finish`: the reason it ends the sequence), in the chunk it
        completes, or None while the chunk still waits for more (--stream-interval)."""
        first = self.generated == 0
        self.generated += 1
        self._held.append(token_id)
        if logprobs is not None:
            self._held_logprobs.append(logprobs)
        if first or finish is not None or len(self._held) >= self._interval:
            return self.flush()
        return None

    def flush(self) -> pb.GenerateResponse | None:
        """The tokens held back, if any, in one chunk sent now (the sequence ended or failed)."""
        if not self._held:
            return None
        ids, logprobs = self._held, self._held_logprobs
        self._held, self._held_logprobs = [], []
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            if self._observer is not None:
                self._observer.stage(Stage.FIRST_TOKEN, self.first_token_at - self._started)
        chunk = pb.TokenChunk(token_ids=ids, text=self._text.feed(ids), index=self.index)
        if logprobs:
            chunk.logprobs.extend(logprobs_message(lp) for lp in logprobs)
        return pb.GenerateResponse(chunk=chunk)

    def tail(self) -> pb.GenerateResponse | None:
        """The end of the sequence: tokens still held and the text still held back (an
        incomplete character), if any."""
        held = self.flush()
        rest = self._text.finish()
        if held is None:
            return pb.GenerateResponse(chunk=pb.TokenChunk(text=rest, index=self.index)) if rest else None
        held.chunk.text += rest
        return held


def prompt_response(lps: Sequence[TokenLogprobs] | None, prompt: Sequence[int], k: int, field: str) -> pb.GenerateResponse:
    """The prompt's logprobs as prefill computed them (checked: one per prompt token but the first)."""
    tokens = [logprobs_message(lp) for lp in checked_prompt(lps, prompt, k, field)]
    return pb.GenerateResponse(prompt_logprobs=pb.PromptLogprobs(tokens=tokens))


def client_stream(host: EngineHost, req: RequestContext, observer: Observer | None, *, index: int = 0) -> ClientStream:
    """A new `ClientStream` for sequence `index` of `req`, its text decoded by the engine's tokenizer,
    its tokens coalesced as the request's stream interval says; its first token reported to `observer`."""
    return ClientStream(tokenizer.for_engine(host.engine).stream(), req.started, observer, index, req.stream_interval)


def summary(
    req: RequestContext,
    out: ClientStream,
    finish: FinishReason,
    transfer: Transfer | ComputedHere,
    checks: StateChecks,
    *,
    transferred: int,
    digest_check_seconds: float = 0.0,
    read: bool = True,
    cached_tokens: int | None = None,
) -> pb.GenerateResponse:
    """`read`: False when the request ended before any state was READ (or checked).
    `cached_tokens`: prompt tokens from decode's caches (None: what the manifest skipped).
    `checks`: the checks a state READ (or restored) goes through."""
    started = req.started
    if isinstance(transfer, ComputedHere):
        engine_id, target, manifest, stats, restored = checks.host.engine_id, "", None, ReadStats(), False
    else:
        engine_id, target, manifest, stats = transfer.link.engine_id, transfer.link.target, transfer.manifest, transfer.stats
        restored = transfer.restored
    if cached_tokens is None:
        cached_tokens = manifest.skipped_tokens if manifest is not None and read else 0
    sequences = [out, *out.forks]
    return pb.GenerateResponse(
        summary=pb.GenerateSummary(
            request_id=req.request_id,
            prompt_token_count=len(req.prompt),
            generated_token_count=sum(s.generated for s in sequences),
            num_transferred_tokens=transferred,
            finish_reason=finish_reason_message(finish),
            prefill_engine_id=engine_id,
            prefill_target=target,
            transfer=pb.TransferStats(
                attention_bytes=stats.attention_bytes,
                conv_bytes=stats.conv_bytes,
                ssm_bytes=stats.ssm_bytes,
                total_bytes=stats.total_bytes,
                read_count=stats.read_count,
                descriptor_count=stats.descriptor_count,
            ),
            prefill_duration=duration(transfer.prefill_seconds),
            read_duration=duration(stats.seconds),
            time_to_first_token=duration((out.first_token_at or time.monotonic()) - started),
            total_duration=duration(time.monotonic() - started),
            state_verified=checks.check_state and read,
            digests_verified=checks.host.verify_transfer and read,  # a restored checkpoint: its own digests
            digest_check_duration=duration(digest_check_seconds),
            prefill_digest_duration=nanoseconds(manifest.digest_ns if manifest is not None else 0),
            prefill_engine_duration=nanoseconds(
                manifest.engine_ns if manifest is not None else int(transfer.engine_seconds * 1e9)
            ),
            first_step_engine_duration=duration(out.first_step_seconds),
            seed=req.sampling.seed,
            prefix_cached_tokens=cached_tokens,
            prefix_state_reused=restored,
            prefilled_locally=isinstance(transfer, ComputedHere),
            finish_reasons=[finish_reason_message(s.finish) for s in sequences] if out.forks else [],
            generated_token_counts=[s.generated for s in sequences] if out.forks else [],
        )
    )
