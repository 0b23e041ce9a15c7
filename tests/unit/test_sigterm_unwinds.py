"""A pytest run stopped with SIGTERM tears its fixtures down (tests/sigterm.py): a real pytest
in a subprocess, its test holding a fixture, gets SIGTERM mid-test; the fixture's teardown must
have run. Negative control: the same run without the plugin leaves no teardown behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HELD = """
import time
from pathlib import Path

import pytest

OUT = Path(__file__).parent


@pytest.fixture
def held():
    yield
    (OUT / "torn-down").write_text("yes")


def test_waits(held):
    (OUT / "started").write_text("yes")
    time.sleep(60)
"""


def run_and_terminate(tmp_path: Path, plugin: bool) -> tuple[int, bool]:
    """Start pytest on a test that holds a fixture, SIGTERM it once the test runs; its exit
    status and whether the fixture was torn down."""
    (tmp_path / "test_held.py").write_text(HELD)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_held.py")]
    if plugin:
        args[3:3] = ["-p", "tests.sigterm"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(3000):  # the test has started (polled: never timed)
            if (tmp_path / "started").exists() or child.poll() is not None:
                break
            time.sleep(0.01)
        assert (tmp_path / "started").exists(), "the held test never started"
        child.send_signal(signal.SIGTERM)
        status = child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return status, (tmp_path / "torn-down").exists()


def test_sigterm_tears_the_fixtures_down(tmp_path: Path) -> None:
    status, torn_down = run_and_terminate(tmp_path, plugin=True)
    assert torn_down
    assert status == pytest.ExitCode.INTERRUPTED


def test_negative_control_without_the_plugin_nothing_is_torn_down(tmp_path: Path) -> None:
    status, torn_down = run_and_terminate(tmp_path, plugin=False)
    assert not torn_down
    assert status == -signal.SIGTERM
