"""A test run stopped with SIGTERM (a CI job's timeout, `kill`) unwinds as one stopped with Ctrl-C:
pytest then tears down every fixture still set up, so the network namespaces and service
processes the hosts tests made go too, where the default action ended the run on the spot.

Installed by tests/conftest.py; also a plugin of its own (`-p tests.sigterm`), for the test that
checks it."""

from __future__ import annotations

import signal
from types import FrameType

import pytest


def unwind_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    unwind_on_sigterm()
