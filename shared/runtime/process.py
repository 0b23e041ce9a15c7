"""Process entry for both services: logging, the event loop (uvloop or asyncio), and exit codes (0 after a clean drain, 2 for invalid settings, 1 for any other start failure)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from shared.config import ServiceSettings
from shared.errors import InvalidArgument, ServiceError
from shared.logs.setup import configure_logging
from shared.otel.setup import configure_tracing, shutdown_tracing

log = logging.getLogger(__name__)


def event_loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run_service(settings: ServiceSettings, serve: Callable[[ServiceSettings], Coroutine[Any, Any, None]]) -> int:
    configure_logging(settings.log_level, settings.log_format, service=f"{settings.role}-svc", engine_id=settings.engine_id)
    configure_tracing(f"{settings.role}-svc", settings.engine_id)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(settings.loop)) as runner:
            runner.run(serve(settings))
    except ServiceError as e:
        print(f"{settings.role}-svc: {e.status}: {e.message}", file=sys.stderr)
        return 2 if isinstance(e, InvalidArgument) else 1
    except OSError as e:
        print(f"{settings.role}-svc: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        shutdown_tracing()  # the spans still queued are exported before the process exits
    return 0
