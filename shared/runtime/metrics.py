"""What one service exposes on `--metrics-port` (Prometheus text): the shared `Telemetry`
metrics, plus gauges read from live state at scrape time so they can never drift from it:
cache blocks in use, pinned requests, open sessions, READ handles not yet released, READs in
flight, remote agents loaded, and the process's resident memory and open file descriptors.

Fault tests read these from outside the process: after every fault the block gauges must be
back to zero and the handle gauges must not grow. Scrapes run on the HTTP server's thread;
the callbacks only read sizes and counters (single, GIL-atomic reads).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import Gauge, ProcessCollector, start_http_server

from shared.observe import Observer
from shared.telemetry import Telemetry

if TYPE_CHECKING:
    from shared.runtime.engine_host import EngineHost

log = logging.getLogger(__name__)


class ServiceMetrics:
    def __init__(self, role: str) -> None:
        self.telemetry = Telemetry(role)
        self.registry = self.telemetry.registry
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, process_open_fds, ...
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value is `read()` at scrape time."""
        Gauge(name, documentation, registry=self.registry).set_function(read)

    def watch_host(self, host: EngineHost) -> None:
        """Block accounting and data-path handles of the engine host."""
        t = self.telemetry
        # One allocator per engine (a request's block ids are the same on every rank): one value.
        t.blocks_in_use.set_function(lambda: host.allocator.num_used)
        t.blocks_capacity.set_function(lambda: host.num_blocks)
        t.requests_queued_for_blocks.set_function(lambda: host.waiting_for_blocks)
        host.observer = Observer(t)
        self.gauge(
            "hybrid_pd_open_read_handles", "NIXL READ handles not released yet (in flight, or a cancel that failed)",
            lambda: sum(agent.live_xfers for agent in host.agents),
        )  # fmt: skip
        self.gauge("hybrid_pd_reads_in_flight", "READs being waited for", lambda: host.poller.in_flight)

    def unknown_notification(self, agent_name: str, sender: str, message: bytes) -> None:
        """Poller callback: a notification nobody waits for (late, or for an unknown request)."""
        self.telemetry.unknown_notifications.inc()

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP on a daemon thread; returns the bound port (0 picks one)."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = int(self._server.server_port)
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def exposition(self) -> str:
        return self.telemetry.exposition()


def announce_metrics_port(port: int) -> None:
    """Printed before `LISTENING port=N`, so scripts that started with --metrics-port 0 find it."""
    print(f"METRICS port={port}", file=sys.stdout, flush=True)
