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
class Outcome:
    """Filled while a generation runs: what `usage` and `finish_reason` report."""

    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str = "length"

    @property
    def usage(self) -> objects.Usage:
        return objects.Usage(self.prompt_tokens, self.completion_tokens)


class Generated:
    """One generation as text pieces: `first()` raises every failure before the first token."""

    def __init__(
        self,
        responses: AsyncIterator[pb.GenerateResponse],
        outcome: Outcome,
        stop: StopMatcher,
        early: EarlyStop,
        rename: Callable[[ServiceError], ServiceError],
        text: Tokenizer,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = text
        self._min_tokens = min_tokens  # stop sequences end nothing before this many tokens
        self._responses = responses
        self.outcome = outcome
        self._stop = stop
        self._early = early
        self._rename = rename
        self._first: pb.GenerateResponse | None = None
        self.prompt_logprobs: list[TokenLogprobs] = []  # when asked: prompt tokens 1..N-1's

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

    async def pieces(self) -> AsyncIterator[tuple[str, list[TokenLogprobs]]]:
        """Text to emit, in order (may be empty strings), with the logprobs of the tokens it
        came from (when asked); ends at max_tokens or a stop sequence.

        With stop sequences the ids are decoded here one token at a time (the tokenizer
        Generation uses), so a match stops at the token that completed it and `usage` counts
        exactly the tokens up to it; without, the chunks' own text is passed through."""
        per_token = self._tokenizer.stream() if self._stop.stops else None
        try:
            response = self._first
            while response is not None:
                if response.WhichOneof("payload") == "summary" and response.summary.finish_reason == pb.FINISH_REASON_STOP:
                    self.outcome.finish_reason = "stop"  # an EOS or stop token id
                if response.WhichOneof("payload") == "chunk":
                    chunk = response.chunk
                    if per_token is None:
                        self.outcome.completion_tokens += len(chunk.token_ids)
                        yield self._stop.feed(chunk.text), [logprobs_of(lp) for lp in chunk.logprobs]
                    else:
                        text, used = self._feed_tokens(per_token, chunk.token_ids)
                        yield text, [logprobs_of(lp) for lp in chunk.logprobs[:used]]
                    if self._stop.stopped:
                        self.outcome.finish_reason = "stop"
                        self._early.stopped = True
                        return
                response = await anext(self._responses, None)
            rest = self._stop.feed(per_token.finish()) + self._stop.finish() if per_token else self._stop.finish()
            yield rest, []
        finally:
            await self.aclose()

    def _feed_tokens(self, decoder: TextStream, ids: Sequence[int]) -> tuple[str, int]:
        """The text of `ids` up to a stop sequence, and how many of them it took."""
        out = []
        for token in ids:
            self.outcome.completion_tokens += 1
            armed = self.outcome.completion_tokens >= self._min_tokens
            out.append(self._stop.feed(decoder.feed([token]), armed=armed))
            if self._stop.stopped:
                break
        return "".join(out), len(out)

    async def aclose(self) -> None:
        """Ends the generation (frees its blocks) if it is still running; idempotent."""
        await self._responses.aclose()  # type: ignore[attr-defined]

    async def text(self) -> tuple[str, list[TokenLogprobs]]:
        """The whole text, and the logprobs of its tokens (when asked)."""
        texts: list[str] = []
        logprobs: list[TokenLogprobs] = []
        try:
            async for text, lps in self.pieces():
                texts.append(text)
                logprobs += lps
            return "".join(texts), logprobs
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
        generated, rid = await self._start(request, params, ids, "prompt", echo=params.echo)
        header = objects.Header.new(f"cmpl-{rid}", model)
        shaped = CompletionLogprobs(self.tokenizer) if params.logprobs is not None else None
        echoed = ""
        echoed_logprobs: dict[str, Any] | None = None
        if params.echo:  # vLLM's: the prompt's text as given (token ids decoded), then the completion's
            echoed = params.prompt if isinstance(params.prompt, str) else self.tokenizer.decode(params.prompt)
            if shaped is not None:
                echoed_logprobs = shaped.prompt_part(ids[0], generated.prompt_logprobs)
        if not params.stream:
            text, logprobs = await generated.text()
            out = generated.outcome
            body = objects.completion(header, echoed + text, out.finish_reason, out.usage)
            if shaped is not None:
                part = shaped.part(logprobs)
                if echoed_logprobs is not None:
                    part = {name: echoed_logprobs[name] + part[name] for name in part}
                body["choices"][0]["logprobs"] = part
            return JSONResponse(body)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            if params.echo:
                chunk = objects.completion_chunk(header, echoed, None, params.include_usage)
                chunk["choices"][0]["logprobs"] = echoed_logprobs
                yield chunk
            async for piece, logprobs in generated.pieces():
                if piece or logprobs:
                    chunk = objects.completion_chunk(header, piece, None, params.include_usage)
                    if shaped is not None:
                        chunk["choices"][0]["logprobs"] = shaped.part(logprobs)
                    yield chunk
            yield objects.completion_chunk(header, "", generated.outcome.finish_reason, params.include_usage)
            if params.include_usage:
                yield objects.usage_chunk(header, "text_completion", generated.outcome.usage)

        return _sse(chunks(), generated)

    async def chat(self, request: Request) -> Response:
        params = parse_chat(await json_body(request))
        model = check_model(self.info, params.model)
        ids = prompt_ids(params, self.tokenizer.encode, self.template)
        generated, rid = await self._start(request, params, ids, "messages")
        header = objects.Header.new(f"chatcmpl-{rid}", model)
        wants = params.logprobs is not None
        if not params.stream:
            text, logprobs = await generated.text()
            out = generated.outcome
            body = objects.chat_completion(header, text, out.finish_reason, out.usage)
            if wants:
                body["choices"][0]["logprobs"] = chat_logprobs(self.tokenizer, logprobs)
            return JSONResponse(body)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            yield objects.chat_chunk(header, {"role": "assistant", "content": ""}, None, params.include_usage)
            async for piece, logprobs in generated.pieces():
                if piece or logprobs:
                    chunk = objects.chat_chunk(header, {"content": piece}, None, params.include_usage)
                    if wants:
                        chunk["choices"][0]["logprobs"] = chat_logprobs(self.tokenizer, logprobs)
                    yield chunk
            yield objects.chat_chunk(header, {}, generated.outcome.finish_reason, params.include_usage)
            if params.include_usage:
                yield objects.usage_chunk(header, "chat.completion.chunk", generated.outcome.usage)

        return _sse(chunks(), generated)

    async def _start(
        self, request: Request, params: CommonParams, ids: list[int], prompt_field: str, *, echo: bool = False
    ) -> tuple[Generated, str]:
        """Validate against this engine, start the generation and wait for its first token.
        `echo` with logprobs: prefill computes the prompt's too."""
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
        )
        if params.logprobs is not None:
            grpc_request.logprobs = params.logprobs
            if echo:
                grpc_request.prompt_logprobs = params.logprobs
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
            Outcome(prompt_tokens=len(ids)),
            StopMatcher(params.stop),
            early,
            lambda e: renamed(e, names),
            self.tokenizer,
            params.min_tokens,
        )
        await generated.first()
        return generated, rid


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
