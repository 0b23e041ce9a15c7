"""Prefill's HTTP side of vLLM's P/D protocol: the prefill leg (`POST /v1/completions` with
`kv_transfer_params.do_remote_decode`).

Validated here; serving it needs domain calls prefill does not have yet (compute the prompt's
state outside a Session, pin it under a lease that starts when this response is sent, and
answer `kv_transfer_params.prefill_answer(...)`), so a well-formed prefill leg gets a clear 501
naming the field, and anything else a 400: this engine only prefills.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shared.errors import InvalidArgument
from shared.http.app import ServiceInfo, api, check_model, json_body
from shared.http.errors import NotImplementedYet
from shared.http.kv_transfer import wants_remote_decode
from shared.http.params import CommonParams, parse_chat, parse_completion


class PrefillHttp:
    def __init__(self, info: ServiceInfo) -> None:
        self.info = info

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", api(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", api(self.chat), methods=["POST"]),
        ]

    async def completions(self, request: Request) -> Response:
        return self._prefill_leg(parse_completion(await json_body(request)))

    async def chat(self, request: Request) -> Response:
        return self._prefill_leg(parse_chat(await json_body(request)))

    def _prefill_leg(self, params: CommonParams) -> Response:
        check_model(self.info, params.model)
        if not wants_remote_decode(params.kv_transfer_params):
            raise InvalidArgument(
                "this is a prefill engine: it answers the prefill leg of a P/D router "
                '("kv_transfer_params": {"do_remote_decode": true}); send completions to a decode engine',
                field="kv_transfer_params",
            )
        raise NotImplementedYet(
            "the prefill leg (compute, pin under a lease, answer kv_transfer_params) is not served yet",
            field="kv_transfer_params.do_remote_decode",
        )
