"""Prefill's HTTP side of vLLM's P/D protocol: the prefill leg (`POST /v1/completions` or
`/v1/chat/completions` with `kv_transfer_params.do_remote_decode`).

The prompt's state is computed and pinned for the decode engine that will claim it
(prefill_svc/handoff.py); the answer is an OpenAI completion object (no text: the first token
is decode's) plus the `kv_transfer_params` that decode leg needs: this engine, its gRPC address
for the handshake, the request, its block ids per KV-cache group, and ours (boundary,
incarnation, transfer id) under `hybrid_pd`. The lease counts from when the answer was sent.
Anything but a prefill leg is a 400: this engine only prefills.
"""

from __future__ import annotations

import secrets
import socket
import uuid
from collections.abc import Callable

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from prefill_svc.handoff import Handoffs
from shared import limits
from shared.config import split_advertised
from shared.engine.sampling import SamplingError, SamplingParams
from shared.errors import InvalidArgument, ServiceError
from shared.http import objects
from shared.http.app import ServiceInfo, api, check_model, json_body
from shared.http.chat_template import ChatTemplate
from shared.http.errors import renamed
from shared.http.kv_transfer import prefill_answer, wants_remote_decode
from shared.http.params import ChatParams, CompletionParams, parse_chat, parse_completion
from shared.http.params import SamplingParams as HttpSampling
from shared.http.render import prompt_ids
from shared.runtime.engine_host import EngineHost

REQUEST_ID_HEADER = "x-request-id"
WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def advertised_address(advertise: str | None, listen_host: str, grpc_port: int) -> tuple[str, int]:
    """The gRPC address decode engines dial: `--advertise-address` (its port defaults to the bound
    one), else the listen host, else (listening on every address) this machine's hostname."""
    if advertise:
        host, port = split_advertised(advertise)
        return host, port if port is not None else grpc_port
    host = listen_host.strip("[]") if listen_host not in WILDCARD_HOSTS else socket.gethostname()
    return host, grpc_port


def first_token_sampling(s: HttpSampling) -> SamplingParams:
    """How the prefill leg draws the first token at the full-N boundary: with the body's sampling,
    as the decode leg (sent the same body) draws the rest. Without a seed in the body each leg
    picks its own, so only seeded sampled requests are reproducible across the two legs. The
    body's min_tokens is the router's (it sends 1, or none), not the client's, so the draw masks
    nothing: the decode leg, sent the client's body, masks its tokens. (Decode legs take n-1
    state only today; one at full-N must not use a first token its min_tokens masks.)"""
    seed = limits.seed_bits(s.seed) if s.seed is not None else (secrets.randbits(64) if s.temperature > 0 else 0)
    try:
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=seed)
    except SamplingError as e:
        raise InvalidArgument(e.detail, field=e.field) from None


class PrefillHttp:
    def __init__(
        self,
        info: ServiceInfo,
        host: EngineHost,
        handoffs: Handoffs,
        template: ChatTemplate,
        encode: Callable[[str], list[int]],
        address: Callable[[], tuple[str, int]],
    ) -> None:
        self.info = info
        self.host = host
        self.handoffs = handoffs
        self.template = template
        self.encode = encode
        self.address = address  # called per answer: the gRPC port is known only once bound

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", api(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", api(self.chat), methods=["POST"]),
        ]

    async def completions(self, request: Request) -> Response:
        return await self._prefill_leg(request, parse_completion(await json_body(request)), "prompt")

    async def chat(self, request: Request) -> Response:
        return await self._prefill_leg(request, parse_chat(await json_body(request)), "messages")

    async def _prefill_leg(self, request: Request, params: CompletionParams | ChatParams, prompt_field: str) -> Response:
        model = check_model(self.info, params.model)
        if not wants_remote_decode(params.kv_transfer_params):
            raise InvalidArgument(
                "this is a prefill engine: it answers the prefill leg of a P/D router "
                '("kv_transfer_params": {"do_remote_decode": true}); send completions to a decode engine',
                field="kv_transfer_params",
            )
        ids = prompt_ids(params, self.encode, self.template)
        rid = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        names = {"job.prompt_token_ids": prompt_field, "job.request_id": "X-Request-Id", "job.timeout": "kv_transfer_params"}
        try:
            manifest = await self.handoffs.prefill(rid, ids, sampling=first_token_sampling(params.sampling))
        except ServiceError as e:
            raise renamed(e, names) from None
        host, port = self.address()
        kv = prefill_answer(
            engine_id=self.host.engine_id,
            request_id=rid,
            host=host,
            port=port,
            block_ids=[ids.tolist() for ids in manifest.block_ids],
            tp_size=self.host.layout.tp,
            num_tokens=len(ids),
            num_computed_tokens=manifest.num_computed_tokens,
            expiry_time=manifest.lease_expire_time_ns / 1e9,
            incarnation=self.host.incarnation,
            transfer_id=manifest.transfer_id,
        )
        usage = objects.Usage(len(ids), 0)
        if isinstance(params, ChatParams):
            body = objects.chat_completion(
                objects.Header.new(f"chatcmpl-{rid}", model), [objects.chat_choice(0, "", "length")], usage
            )
        else:
            body = objects.completion(
                objects.Header.new(f"cmpl-{rid}", model), [objects.completion_choice(0, "", "length")], usage
            )
        body["kv_transfer_params"] = kv
        return JSONResponse(body, background=BackgroundTask(self.handoffs.sent, rid))
