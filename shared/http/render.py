"""vLLM's render endpoints (`/v1/completions/render`, `/v1/chat/completions/render`), pure:
the request as the engine would run it, without running it. Completions answer a list with one
token-in GenerateRequest per prompt; chat answers one object."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shared.http.app import ServiceInfo, api, check_model, json_body
from shared.http.chat_template import ChatTemplate
from shared.http.params import ChatParams, CommonParams, CompletionParams, parse_chat, parse_completion


def generate_request(params: CommonParams, token_ids: list[int], model: str, request_id: str, max_tokens: int) -> dict[str, Any]:
    s = params.sampling
    return {
        "request_id": request_id,
        "model": model,
        "token_ids": token_ids,
        "sampling_params": {
            "n": 1,
            "max_tokens": max_tokens,
            "min_tokens": params.min_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "seed": s.seed,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
        },
        "stream": params.stream,
        "stream_options": {"include_usage": params.include_usage} if params.stream else None,
        "kv_transfer_params": params.kv_transfer_params,
        "token_offsets": None,
    }


def prompt_ids(params: CompletionParams | ChatParams, encode: Callable[[str], list[int]], template: ChatTemplate) -> list[int]:
    """The token ids a request runs on: its prompt (text or ids), or its rendered chat messages."""
    if isinstance(params, ChatParams):
        return encode(template.render(params.messages))
    return encode(params.prompt) if isinstance(params.prompt, str) else list(params.prompt)


class RenderRoutes:
    """Both services answer render, as vLLM workers do (routers call it on every worker)."""

    def __init__(self, info: ServiceInfo, encode: Callable[[str], list[int]], template: ChatTemplate) -> None:
        self.info = info
        self.encode = encode
        self.template = template

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions/render", api(self.completions), methods=["POST"]),
            Route("/v1/chat/completions/render", api(self.chat), methods=["POST"]),
        ]

    def _one(self, params: CompletionParams | ChatParams, prefix: str, request: Request) -> dict[str, Any]:
        model = check_model(self.info, params.model)
        ids = prompt_ids(params, self.encode, self.template)
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, self.info.max_model_len() - len(ids))
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        return generate_request(params, ids, model, f"{prefix}-{rid}", max_tokens)

    async def completions(self, request: Request) -> Response:
        params = parse_completion(await json_body(request))
        return JSONResponse([self._one(params, "cmpl", request)])

    async def chat(self, request: Request) -> Response:
        params = parse_chat(await json_body(request))
        return JSONResponse(self._one(params, "chatcmpl", request))
