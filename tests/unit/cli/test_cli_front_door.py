"""The command line meets bad input and Ctrl-C with one line and an exit code, never a traceback;
every command answers --version."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpd_tools.cli.main import main
from shared.config import build_parser
from shared.layout.models import load_model
from shared.layout.spec import LayoutError
from shared.version import version


def test_version_on_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"hybrid-pd {version()}"
    for role in ("prefill", "decode"):
        with pytest.raises(SystemExit) as done:
            build_parser(role).parse_args(["--version"])  # type: ignore[arg-type]
        assert done.value.code == 0 and capsys.readouterr().out.strip() == f"{role}-svc {version()}"


@pytest.mark.parametrize("value", ["-3", "0", "many"])
def test_a_bad_max_tokens_names_the_flag(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "--colocated", "--model", "tiny-mamba2", "--prompt", "hi", "--max-tokens", value])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--max-tokens" in err and ">= 1" in err and "Traceback" not in err


def test_a_negative_min_tokens_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["generate", "--colocated", "--model", "tiny-mamba2", "--prompt", "hi", "--min-tokens", "-1"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--min-tokens" in err and ">= 0" in err and "Traceback" not in err


def test_a_missing_config_file_is_named(tmp_path: os.PathLike[str]) -> None:
    missing = os.path.join(str(tmp_path), "missing", "config.json")
    with pytest.raises(LayoutError, match=f"^{re.escape(missing)} does not exist$"):
        load_model(missing)
    with pytest.raises(LayoutError, match=r"config\.json does not exist: a checkpoint directory"):
        load_model(str(tmp_path))


def test_an_error_inside_a_command_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: os.PathLike[str]) -> None:
    missing = os.path.join(str(tmp_path), "nope.json")
    code = main(["plan", "--model", missing, "--prefill-tp", "1", "--decode-tp", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and "Traceback" not in err


def _sigint_as_at_a_terminal() -> None:
    """In the child before exec: SIGINT's default action. A test run started in the background
    of a non-interactive shell has SIGINT ignored, which exec keeps and Python then honours (no
    KeyboardInterrupt at all): the Ctrl-C tests would test the shell, not the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*argv: str, pythonpath: str = "") -> subprocess.Popen[str]:
    path = os.pathsep.join(p for p in (pythonpath, os.getcwd()) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "hybridpd_tools.cli.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        preexec_fn=_sigint_as_at_a_terminal,
    )


@pytest.mark.timeout(120)
def test_ctrl_c_ends_with_one_line_and_130() -> None:
    """A real SIGINT to a real long-running command (a descriptor-id sweep), sent once the sweep
    has said it began (its progress line), not after a guessed time."""
    proc = _cli("bench", "descids", "--blocks", "100000", "--repeat", "100000")
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith("bench descids ["), first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "hybrid-pd bench: interrupted"


INTERRUPT_WHILE_LOADING = """
import os, signal, sys

class InterruptAtGrpc:  # sends this process a SIGINT as the commands' modules start loading grpc
    def find_spec(self, name, path=None, target=None):
        if name == "grpc":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptAtGrpc())
"""


@pytest.mark.timeout(120)
def test_ctrl_c_while_the_commands_load_is_one_line_too(tmp_path: Path) -> None:
    """Loading the commands takes seconds on a busy machine: a Ctrl-C then (forced here, at the
    import of grpc) ends like one during the command. Before the imports moved under main's
    handling, this printed a traceback and the process died of the signal."""
    (tmp_path / "sitecustomize.py").write_text(INTERRUPT_WHILE_LOADING)
    proc = _cli("bench", "descids", "--blocks", "10", "--repeat", "1", pythonpath=str(tmp_path))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "hybrid-pd: interrupted"
