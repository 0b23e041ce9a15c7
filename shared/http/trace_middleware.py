"""The server span of each HTTP request (when tracing is on): a child of the caller's
`traceparent` header when it sent one, current while the request is served, so the decode
request it starts (decode_svc/servicer.py) joins the same trace. Named `METHOD /route` for the
app's routes and `METHOD` alone for any other path (no span name per unknown URL)."""

from __future__ import annotations

from collections.abc import Collection, MutableMapping
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.otel import spans

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class TraceMiddleware:
    def __init__(self, app: Any, routes: Collection[str]) -> None:
        self.app = app
        self.routes = frozenset(routes)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not spans.enabled():
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        known = path in self.routes
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
        attributes = {"http.request.method": method, "url.path": path, **({"http.route": path} if known else {})}
        name = f"{method} {path}" if known else method
        with spans.current(name, kind=SpanKind.SERVER, carrier=headers, attributes=attributes) as span:
            assert span is not None

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_traced)
