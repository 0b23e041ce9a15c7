"""`python -m prefill_svc --http-port 0` as a real process: `HTTP port=N` comes before
`LISTENING port=N`, the HTTP API answers, and SIGTERM still drains to exit 0."""

from __future__ import annotations

import re
import signal
import urllib.request

import pytest

from hybridpd_tools.bench.local_pair import start_service

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_http_port_line_then_listening_then_clean_exit() -> None:
    service = start_service(
        "prefill", ["--model", "tiny-mamba2", "--engine", "synthetic", "--num-blocks", "64", "--http-port", "0"]
    )
    try:
        lines = [line for line in service.output if re.match(r"(HTTP|LISTENING) port=\d+$", line)]
        assert [line.split()[0] for line in lines] == ["HTTP", "LISTENING"]
        http_port = int(lines[0].split("=")[1])
        assert http_port != service.port
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as reply:
            assert reply.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as reply:
            assert b"hybrid_pd_blocks_in_use" in reply.read()
        service.proc.send_signal(signal.SIGTERM)
        assert service.proc.wait(30) == 0
    finally:
        if service.proc.poll() is None:
            service.proc.kill()
            service.proc.wait()
