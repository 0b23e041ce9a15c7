"""`hybrid-pd bench e2e --prefill-threads N --decode-threads N`: passed on to the services the bench
starts (prefill's to prefill, decode's to every decode service), not to the colocated baseline;
omitted, nothing is passed and the services' defaults apply; 0 is refused naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import pytest

from hybridpd_tools.bench import setups
from hybridpd_tools.bench.local_pair import LocalPair
from hybridpd_tools.bench.setups import SetupConfig, model_spec, start_setups
from hybridpd_tools.cli import bench_cmd
from hybridpd_tools.cli.bench_cmd import e2e as bench_e2e
from hybridpd_tools.cli.bench_cmd.e2e_flags import add_parser
from hybridpd_tools.cli.bench_cmd.running import command_line

pytestmark = pytest.mark.timeout(60)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybrid-pd")
    bench_cmd.register(p.add_subparsers(dest="command", required=True))
    return p


def e2e_setup(*argv: str) -> tuple[argparse.Namespace, SetupConfig]:
    args = parser().parse_args(["bench", "e2e", *argv])
    bench_e2e._engine_and_model(args)
    return args, bench_e2e._setup_config(args, bench_e2e.E2E_FLAGS)


class FakeProcess:
    """A started process, as far as start_setups uses one."""

    def __init__(self, role: str, argv: Sequence[str]) -> None:
        self.role, self.argv = role, list(argv)
        self.address = f"{role}:1"

    def stop(self) -> int:
        return 0


async def started_argvs(monkeypatch: pytest.MonkeyPatch, setup: SetupConfig) -> dict[str, list[str]]:
    """The argv of every process start_setups starts for `setup`, none really started; chunked
    prefill and state checkpoints add the unpipelined and the states decode services."""
    started: dict[str, list[str]] = {}

    def service(role: str, argv: Sequence[str], *_: object, **__: object) -> FakeProcess:
        name = next((a for a in argv if a.startswith("bench-e2e-")), role)  # its --engine-id
        started[name] = list(argv)
        return FakeProcess(role, argv)

    async def pair(prefill_argv: Sequence[str], decode_argv: Sequence[str], *_: object, **__: object) -> LocalPair:
        return LocalPair(service("prefill", prefill_argv), service("decode", decode_argv))  # type: ignore[arg-type]

    async def serving(*_: object, **__: object) -> None:
        return None

    def colocated(argv: Sequence[str], *_: object) -> FakeProcess:
        started["colocated"] = list(argv)
        return FakeProcess("colocated", argv)

    monkeypatch.setattr(setups, "start_pair", pair)
    monkeypatch.setattr(setups, "start_service", service)
    monkeypatch.setattr(setups, "wait_serving", serving)
    monkeypatch.setattr(setups, "Colocated", colocated)
    setup = dataclasses.replace(setup, prefill_chunk_tokens=8)
    spec = model_spec(setup.model, setup.engine)
    async with start_setups(spec, setup, prompt_tokens=16, max_tokens=4, prefix_cache_states=2) as running:
        assert set(running.addresses) == {"disaggregated", "unpipelined", "states", "colocated"}
    assert set(started) == {
        "bench-e2e-prefill",
        "bench-e2e-decode",
        "bench-e2e-decode-unpipelined",
        "bench-e2e-decode-states",
        "colocated",
    }
    return started


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.asyncio
async def test_the_thread_flags_reach_the_services_command_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    args, setup = e2e_setup("--prefill-threads", "2", "--decode-threads", "3")
    assert (setup.prefill_threads, setup.decode_threads) == (2, 3)
    assert command_line("e2e", args, bench_e2e.E2E_FLAGS).endswith("--prefill-threads 2 --decode-threads 3")
    started = await started_argvs(monkeypatch, setup)
    prefill = started.pop("bench-e2e-prefill")
    assert flag_value(prefill, "--prefill-threads") == "2" and "--decode-threads" not in prefill
    colocated = started.pop("colocated")
    assert "--prefill-threads" not in colocated and "--decode-threads" not in colocated  # one compute thread
    for name, argv in started.items():  # every decode service
        assert flag_value(argv, "--decode-threads") == "3", name
        assert "--prefill-threads" not in argv, name


@pytest.mark.asyncio
async def test_omitted_nothing_is_passed_and_the_services_defaults_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRID_PD_PREFILL_THREADS", raising=False)
    monkeypatch.delenv("HYBRID_PD_DECODE_THREADS", raising=False)
    args, setup = e2e_setup()
    assert (args.prefill_threads, args.decode_threads) == (None, None)
    assert (setup.prefill_threads, setup.decode_threads) == (0, 0)
    assert "threads" not in command_line("e2e", args, bench_e2e.E2E_FLAGS)
    for name, argv in (await started_argvs(monkeypatch, setup)).items():
        assert "--prefill-threads" not in argv and "--decode-threads" not in argv, name


@pytest.mark.parametrize("flag", ["--prefill-threads", "--decode-threads"])
def test_zero_threads_are_refused_naming_the_flag(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["bench", "e2e", flag, "0"])
    assert e.value.code == 2
    assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_help_says_what_they_do_and_that_the_services_defaults_apply() -> None:
    sub = argparse.ArgumentParser(prog="hybrid-pd bench").add_subparsers()
    add_parser(sub)
    text = " ".join(sub.choices["e2e"].format_help().split())
    assert "--prefill-threads N the prefill service's --prefill-threads: threads that compute a batched prefill step" in text
    assert "--decode-threads N the decode services' --decode-threads: threads that compute a decode step" in text
    assert text.count("omitted: not passed, the service's default applies") == 2
    assert text.count("The colocated baseline keeps one compute thread") == 2
