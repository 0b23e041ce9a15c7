"""Decode's OpenAI-compatible endpoints: `/v1/completions` and `/v1/chat/completions`.

An adapter over the same domain entry the gRPC Generate handler uses
(`DecodeServicer.generate` -> `Generation.run`): the body becomes a GenerateRequest (token ids,
max_tokens, the `X-Request-Id` header as request id), its token chunks become OpenAI objects or
SSE chunks; a P/D router's decode leg passes its `kv_transfer_params` through as JSON
(decode_svc/learned_peers.py). Stop sequences are applied here, on the text; a match closes the
generation early (its blocks are freed as on any early end), but not one that ends before
min_tokens tokens. A streamed response starts once the first token exists, so every failure
before it (bad input, no prefill, cache full, draining) is a real HTTP status; a failure after it
is sent as a last `data: {"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from decode_svc import tokenizer
from decode_svc.servicer import DecodeServicer, EarlyStop
from shared import limits
from shared.engine.logprobs import TokenLogprobs
from shared.engine.text import TextStream, Tokenizer
from shared.errors import InvalidArgument, ServiceError
from shared.http import objects, sse
from shared.http.app import ServiceInfo, api, check_model, json_body
from shared.http.chat_template import ChatTemplate
from shared.http.errors import http_error, internal_error, renamed
from shared.http.kv_transfer import wants_remote_prefill
from shared.http.logprobs import CompletionLogprobs, chat_logprobs
from shared.http.params import CommonParams, parse_chat, parse_completion
from shared.http.params import SamplingParams as HttpSampling
from shared.http.render import prompt_ids
from shared.http.stop import StopMatcher
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc.logprobs_message import logprobs_of
from shared.runtime.engine_host import EngineHost

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"


@dataclass
class Choice:
    """One of the request's n sequences as the client sees it: its text cut at a stop sequence,
    the tokens up to it, why it ended."""

    stop: StopMatcher
    decoder: TextStream | None  # with stop sequences: the ids decoded one at a time here
    completion_tokens: int = 0
    finish_reason: str = "length"
    done: bool = False  # its stop sequence matched: its later tokens are dropped


@dataclass(frozen=True)
class Piece:
    """Text of one choice to emit (may be empty), with the logprobs of the tokens it came from."""

    index: int
    text: str
    logprobs: list[TokenLogprobs]


class Generated:
    """One generation (of n choices) as text pieces: `first()` raises every failure before the first token."""

    def __init__(
        self,
        responses: AsyncIterator[pb.GenerateResponse],
        prompt_tokens: int,
        stops: Sequence[str],
        n: int,
        early: EarlyStop,
        rename: Callable[[ServiceError], ServiceError],
        text: Tokenizer,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = text
        self._min_tokens = min_tokens  # stop sequences end nothing before this many tokens
        self._responses = responses
        self.prompt_tokens = prompt_tokens
        self.choices = [Choice(StopMatcher(stops), text.stream() if stops else None) for _ in range(n)]
        self._early = early
        self._rename = rename
        self._first: pb.GenerateResponse | None = None
        self.prompt_logprobs: list[TokenLogprobs] = []  # when asked: prompt tokens 1..N-1's

    @property
    def usage(self) -> objects.Usage:
        return objects.Usage(self.prompt_tokens, sum(c.completion_tokens for c in self.choices))

    async def first(self) -> None:
        """Wait for the first token (the prompt's logprobs, when asked, come before it)."""
        try:
            self._first = await anext(self._responses)
            while self._first.WhichOneof("payload") == "prompt_logprobs":
                self.prompt_logprobs = [logprobs_of(lp) for lp in self._first.prompt_logprobs.tokens]
                self._first = await anext(self._responses)
        except ServiceError as e:
            raise self._rename(e) from None
        except StopAsyncIteration:
            self._first = None

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text to emit, in order, per choice; ends at max_tokens or once every choice met a
        stop sequence (which ends the generation early).

        With stop sequences the ids are decoded here one token at a time (the tokenizer
        Generation uses), so a match stops at the token that completed it and `usage` counts
        exactly the tokens up to it; without, the chunks' own text is passed through."""
        try:
            response = self._first
            while response is not None:
                kind = response.WhichOneof("payload")
                if kind == "summary":
                    self._finish_reasons(response.summary)
                elif kind == "chunk" and response.chunk.index < len(self.choices):
                    piece = self._feed(response.chunk)
                    if piece is not None:
                        yield piece
                    if all(c.done for c in self.choices):
                        self._early.stopped = True
                        return
                response = await anext(self._responses, None)
            for i, c in enumerate(self.choices):
                if c.done:
                    continue
                rest = c.stop.feed(c.decoder.finish()) + c.stop.finish() if c.decoder else c.stop.finish()
                yield Piece(i, rest, [])
        finally:
            await self.aclose()

    def _finish_reasons(self, summary: pb.GenerateSummary) -> None:
        reasons = list(summary.finish_reasons) or [summary.finish_reason]
        for c, reason in zip(self.choices, reasons, strict=False):
            if reason == pb.FINISH_REASON_STOP:
                c.finish_reason = "stop"  # an EOS or stop token id

    def _feed(self, chunk: pb.TokenChunk) -> Piece | None:
        c = self.choices[chunk.index]
        if c.done:
            return None
        if c.decoder is None:
            c.completion_tokens += len(chunk.token_ids)
            piece = Piece(chunk.index, c.stop.feed(chunk.text), [logprobs_of(lp) for lp in chunk.logprobs])
        else:
            text, used = self._feed_tokens(c, c.decoder, chunk.token_ids)
            piece = Piece(chunk.index, text, [logprobs_of(lp) for lp in chunk.logprobs[:used]])
        if c.stop.stopped:
            c.finish_reason, c.done = "stop", True
        return piece

    def _feed_tokens(self, c: Choice, decoder: TextStream, ids: Sequence[int]) -> tuple[str, int]:
        """The text of `ids` up to a stop sequence, and how many of them it took."""
        out = []
        for token in ids:
            c.completion_tokens += 1
            armed = c.completion_tokens >= self._min_tokens
            out.append(c.stop.feed(decoder.feed([token]), armed=armed))
            if c.stop.stopped:
                break
        return "".join(out), len(out)

    async def aclose(self) -> None:
        """Ends the generation (frees its blocks) if it is still running; idempotent."""
        await self._responses.aclose()  # type: ignore[attr-defined]

    async def texts(self) -> list[tuple[str, list[TokenLogprobs]]]:
        """Each choice's whole text, and the logprobs of its tokens (when asked)."""
        texts: list[list[str]] = [[] for _ in self.choices]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in self.choices]
        try:
            async for piece in self.pieces():
                texts[piece.index].append(piece.text)
                logprobs[piece.index] += piece.logprobs
            return [("".join(t), lps) for t, lps in zip(texts, logprobs, strict=True)]
        finally:
            await self.aclose()


class DecodeHttp:
    def __init__(self, servicer: DecodeServicer, host: EngineHost, info: ServiceInfo, template: ChatTemplate) -> None:
        self.servicer = servicer
        self.host = host
        self.info = info
        self.template = template
        self.tokenizer = tokenizer.for_engine(host.engine)  # the engine's, or bytes

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", api(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", api(self.chat), methods=["POST"]),
        ]

    async def completions(self, request: Request) -> Response:
        params = parse_completion(await json_body(request))
        model = check_model(self.info, params.model)
        ids = prompt_ids(params, self.tokenizer.encode, self.template)
        best_of = params.best_of > params.n  # the best n of best_of, by cumulative logprob (not streamed)
        scored = params.logprobs if params.logprobs is not None or not best_of else 0
        generated, rid = await self._start(request, params, ids, "prompt", echo=params.echo, n=params.best_of, logprobs=scored)
        header = objects.Header.new(f"cmpl-{rid}", model)
        n = len(generated.choices)
        shaped = [CompletionLogprobs(self.tokenizer) for _ in range(n)] if params.logprobs is not None else None
        echoed = ""
        echoed_logprobs: list[dict[str, Any] | None] = [None] * n
        if params.echo:  # vLLM's: the prompt's text as given (token ids decoded), then the completion's
            echoed = params.prompt if isinstance(params.prompt, str) else self.tokenizer.decode(params.prompt)
            if shaped is not None:
                echoed_logprobs = [s.prompt_part(ids[0], generated.prompt_logprobs) for s in shaped]
        if not params.stream:
            texts = await generated.texts()
            kept = best_indices(texts, params.n) if best_of else range(n)
            choices = []
            for number, i in enumerate(kept):
                text, logprobs = texts[i]
                part: dict[str, Any] | None = None
                if shaped is not None:
                    part = shaped[i].part(logprobs)
                    before = echoed_logprobs[i]
                    if before is not None:
                        part = {name: before[name] + part[name] for name in part}
                finish = generated.choices[i].finish_reason
                choices.append(objects.completion_choice(number, echoed + text, finish, part))
            return JSONResponse(objects.completion(header, choices, generated.usage))

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            if params.echo:
                for i in range(n):
                    yield objects.completion_chunk(header, echoed, None, params.include_usage, i, echoed_logprobs[i])
            async for p in generated.pieces():
                if p.text or p.logprobs:
                    part = shaped[p.index].part(p.logprobs) if shaped is not None else None
                    yield objects.completion_chunk(header, p.text, None, params.include_usage, p.index, part)
            for i, c in enumerate(generated.choices):
                yield objects.completion_chunk(header, "", c.finish_reason, params.include_usage, i)
            if params.include_usage:
                yield objects.usage_chunk(header, "text_completion", generated.usage)

        return _sse(chunks(), generated)

    async def chat(self, request: Request) -> Response:
        params = parse_chat(await json_body(request))
        model = check_model(self.info, params.model)
        ids = prompt_ids(params, self.tokenizer.encode, self.template)
        generated, rid = await self._start(request, params, ids, "messages")
        header = objects.Header.new(f"chatcmpl-{rid}", model)
        wants = params.logprobs is not None
        n = len(generated.choices)
        if not params.stream:
            choices = [
                objects.chat_choice(
                    i, text, generated.choices[i].finish_reason, chat_logprobs(self.tokenizer, logprobs) if wants else None
                )
                for i, (text, logprobs) in enumerate(await generated.texts())
            ]
            return JSONResponse(objects.chat_completion(header, choices, generated.usage))

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            for i in range(n):
                yield objects.chat_chunk(header, {"role": "assistant", "content": ""}, None, params.include_usage, i)
            async for p in generated.pieces():
                if p.text or p.logprobs:
                    lps = chat_logprobs(self.tokenizer, p.logprobs) if wants else None
                    yield objects.chat_chunk(header, {"content": p.text}, None, params.include_usage, p.index, lps)
            for i, c in enumerate(generated.choices):
                yield objects.chat_chunk(header, {}, c.finish_reason, params.include_usage, i)
            if params.include_usage:
                yield objects.usage_chunk(header, "chat.completion.chunk", generated.usage)

        return _sse(chunks(), generated)

    async def _start(
        self,
        request: Request,
        params: CommonParams,
        ids: list[int],
        prompt_field: str,
        *,
        echo: bool = False,
        n: int | None = None,
        logprobs: int | None = None,
    ) -> tuple[Generated, str]:
        """Validate against this engine, start the generation and wait for its first token.
        `echo` with logprobs: prefill computes the prompt's too. `n` and `logprobs`: other than
        the body's (best_of)."""
        n = params.n if n is None else n
        logprobs = params.logprobs if logprobs is None else logprobs
        max_tokens = params.max_tokens
        if max_tokens is None:  # chat without a limit: whatever the request's capacity leaves
            max_tokens = max(1, self.host.max_tokens() - len(ids))
        rid = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        grpc_request = pb.GenerateRequest(
            request_id=rid,
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            sampling=grpc_sampling(params.sampling),
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            n=n,
        )
        if logprobs is not None:
            grpc_request.logprobs = logprobs
            if echo:
                grpc_request.prompt_logprobs = logprobs
        if wants_remote_prefill(params.kv_transfer_params):  # a P/D router's decode leg: passed through as JSON
            grpc_request.kv_transfer_params = json.dumps(params.kv_transfer_params)
        names = {
            "prompt_token_ids": prompt_field,
            "prompt": prompt_field,
            "max_tokens": params.max_tokens_field,
            "request_id": "X-Request-Id",
            **{f"sampling.{name}": name for name in ("temperature", "top_p", "top_k", "seed")},
            "prompt_logprobs": "echo",
        }
        early = EarlyStop()
        generated = Generated(
            self.servicer.generate(grpc_request, None, early, peer=_client_of(request)),
            len(ids),
            params.stop,
            n,
            early,
            lambda e: renamed(e, names),
            self.tokenizer,
            params.min_tokens,
        )
        await generated.first()
        return generated, rid


def best_indices(texts: Sequence[tuple[str, list[TokenLogprobs]]], n: int) -> list[int]:
    """best_of: the `n` choices of highest cumulative logprob (of the tokens each returns, the
    model's raw logprobs), best first; ties keep the lower index first."""
    scores = [sum(lp.logprob for lp in logprobs) for _, logprobs in texts]
    return sorted(range(len(texts)), key=lambda i: -scores[i])[:n]


def _client_of(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client is not None else ""


def grpc_sampling(s: HttpSampling) -> pb.SamplingParams:
    """The body's sampling as the GenerateRequest's; penalties no engine applies are refused."""
    for name, value in (("presence_penalty", s.presence_penalty), ("frequency_penalty", s.frequency_penalty)):
        if value != 0:
            raise InvalidArgument(f"{value} is not supported: no engine applies penalties (send 0)", field=name)
    out = pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if s.seed is not None:
        out.seed = limits.seed_bits(s.seed)  # OpenAI allows negative seeds: the same bits, unsigned
    return out


def _sse(chunks: AsyncIterator[dict[str, Any]], generated: Generated) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield sse.event(chunk)
        except ServiceError as e:  # after the first token: the status line is sent already
            yield sse.event(http_error(e).body)
        except Exception:
            log.exception("streamed completion failed")
            yield sse.event(internal_error().body)
        finally:  # also when the client went away mid-stream: stop generating, free the blocks
            await chunks.aclose()  # type: ignore[attr-defined]
            await generated.aclose()
        yield sse.DONE

    return StreamingResponse(body(), media_type=sse.SSE_MEDIA_TYPE, headers=sse.SSE_HEADERS)
