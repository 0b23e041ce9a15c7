"""The Starlette app both services serve: `/health`, `/metrics`, `/version`, `/v1/models`, plus
the service's own routes; OpenAI-style error objects for every failure, unknown routes included;
a server span per request when tracing is on (shared/http/trace_middleware.py)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from shared.errors import FieldIssue, InvalidArgument, NotFound, ServiceError
from shared.http.errors import MODEL_NOT_FOUND, HttpError, error_body, http_error, internal_error
from shared.http.objects import model_list
from shared.http.trace_middleware import TraceMiddleware
from shared.version import version

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class ServiceInfo:
    role: str
    model_names: tuple[str, ...]  # --served-model-name (default --model); requests may name any
    ready: Callable[[], bool]  # the gRPC readiness: same meaning, same source
    registry: CollectorRegistry
    max_model_len: Callable[[], int]  # tokens one request can hold, prompt and generated

    @property
    def model_id(self) -> str:
        """The name /v1/models lists and responses carry (vLLM's first served model name)."""
        return self.model_names[0]


def error_response(error: HttpError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


def api(endpoint: Endpoint) -> Endpoint:
    """Domain errors -> their HTTP status and error object; anything else -> 500 (logged)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ServiceError as e:
            return error_response(http_error(e))
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.url.path)
            return error_response(internal_error())

    return wrapped


async def json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"the request body is not valid JSON: {e}", field="body") from None
    except RecursionError:  # arrays or objects nested deeper than the parser's stack
        raise InvalidArgument("the request body is nested too deeply", field="body") from None


def check_model(info: ServiceInfo, model: str | None) -> str:
    """The served model's name (the first served name, as vLLM answers); a request naming none of
    the served names is 404, worded and typed as vLLM's (`NotFoundError`, code 404)."""
    if model is not None and model not in info.model_names:
        message = f"The model `{model}` does not exist."  # vLLM's words, without our "field: " prefix
        raise NotFound(message, issues=[FieldIssue("model", message)], reason=MODEL_NOT_FOUND)
    return info.model_id


def build_app(info: ServiceInfo, routes: Sequence[BaseRoute] = ()) -> Starlette:
    started = int(time.time())

    async def health(request: Request) -> Response:
        if info.ready():
            return Response(status_code=200)
        return JSONResponse(
            error_body(f"{info.role} is not ready", "service_unavailable_error", None, "not_ready"), status_code=503
        )

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(info.registry), media_type=CONTENT_TYPE_LATEST)

    async def get_version(request: Request) -> Response:
        return JSONResponse({"version": version(), "role": info.role})

    async def models(request: Request) -> Response:
        return JSONResponse(model_list([info.model_id], started, info.max_model_len()))

    async def http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, kind, None, None), status_code=exc.status_code, headers=exc.headers)

    every_route = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", get_version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        *routes,
    ]
    paths = [r.path for r in every_route if isinstance(r, Route)]
    return Starlette(
        routes=every_route,
        exception_handlers={HTTPException: http_exception},
        middleware=[Middleware(TraceMiddleware, routes=paths)],
    )
