"""Service settings: flag > env > default, validation naming the flag and the source."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefill_svc.http_api import advertised_address
from shared.config import FLAGS, build_parser, parse_settings


def test_defaults() -> None:
    s = parse_settings("prefill", [], environ={})
    assert (s.model, s.tp, s.device, s.engine, s.port, s.kernel_block_size) == ("tiny-mamba2", 1, "cpu", "synthetic", 50051, 16)
    assert s.num_blocks is None and s.memory_budget == 256 << 20
    assert s.engine_id.startswith("prefill-")
    assert not s.tls.enabled and s.loop == "uvloop" and s.metrics_port is None


def test_flag_beats_env_beats_default() -> None:
    env = {"HYBRID_PD_TP": "4", "HYBRID_PD_PORT": "0", "HYBRID_PD_LEASE_SECONDS": "2.5"}
    s = parse_settings("prefill", ["--tp", "2"], environ=env)
    assert (s.tp, s.port, s.lease_seconds) == (2, 0, 2.5)


def test_repeatable_prefill_from_flags_or_env() -> None:
    s = parse_settings("decode", ["--prefill", "a:1", "--prefill", "[::1]:2"], environ={"HYBRID_PD_PREFILL": "x:9"})
    assert s.prefill == ("a:1", "[::1]:2")
    s = parse_settings("decode", [], environ={"HYBRID_PD_PREFILL": "x:9, y:10"})
    assert s.prefill == ("x:9", "y:10")


def test_decode_without_prefill_serves_pd_decode_legs_only() -> None:
    assert parse_settings("decode", [], environ={}).prefill == ()


def test_advertise_address_for_the_pd_prefill_leg(capsys: pytest.CaptureFixture[str]) -> None:
    s = parse_settings("prefill", ["--advertise-address", "10.0.0.7:6000"], environ={})
    assert advertised_address(s.advertise_address, s.host, 50051) == ("10.0.0.7", 6000)
    s = parse_settings("prefill", [], environ={"HYBRID_PD_ADVERTISE_ADDRESS": "[fd00::1]"})
    assert advertised_address(s.advertise_address, s.host, 50051) == ("fd00::1", 50051)
    assert advertised_address(None, "127.0.0.1", 50051) == ("127.0.0.1", 50051)
    assert advertised_address(None, "0.0.0.0", 1)[0] not in ("0.0.0.0", "")
    for bad in ("host:notaport", "h:70000", ":5"):
        with pytest.raises(SystemExit):
            parse_settings("prefill", ["--advertise-address", bad], environ={})
        assert "--advertise-address" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--tp", "0"], {}, "--tp = '0': must be >= 1"),
        ([], {"HYBRID_PD_TP": "two"}, "--tp (from HYBRID_PD_TP) = 'two'"),
        (["--device", "tpu"], {}, "must be one of cpu, cuda"),
        (["--port", "70000"], {}, "0..65535"),
        (["--memory-budget", "lots"], {}, "512MiB"),
        (["--tls-cert", "/nonexistent.pem"], {}, "no such file"),
        (["--num-blocks", "4", "--memory-budget", "1GiB"], {}, "both given on the command line"),
    ],
)
def test_bad_values_name_flag_and_source(
    argv: list[str], env: dict[str, str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_settings("prefill", argv, environ=env)
    assert needle in capsys.readouterr().err


def test_huge_pages_default_on_and_turn_off_by_flag_or_env(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_settings("prefill", [], environ={}).huge_pages is True
    assert parse_settings("prefill", ["--huge-pages", "off"], environ={}).huge_pages is False
    assert parse_settings("decode", ["--prefill", "a:1"], environ={"HYBRID_PD_HUGE_PAGES": "off"}).huge_pages is False
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--huge-pages", "maybe"], environ={})
    assert "--huge-pages = 'maybe'" in capsys.readouterr().err


def test_cache_size_flag_overrides_the_other_from_env() -> None:
    s = parse_settings("prefill", ["--num-blocks", "12"], environ={"HYBRID_PD_MEMORY_BUDGET": "1GiB"})
    assert (s.num_blocks, s.memory_budget) == (12, None)
    s = parse_settings("prefill", ["--memory-budget", "8MiB"], environ={"HYBRID_PD_NUM_BLOCKS": "3"})
    assert (s.num_blocks, s.memory_budget) == (None, 8 << 20)


def test_tls_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    s = parse_settings("prefill", ["--tls-cert", str(cert), "--tls-key", str(key)], environ={})
    assert s.tls.enabled and s.tls.ca is None
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--tls-cert", str(cert)], environ={})
    assert "go together" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_help_explains_every_flag_and_its_env(role: str) -> None:
    text = " ".join(build_parser(role).format_help().split())  # type: ignore[arg-type]
    for flag in FLAGS:
        if role in flag.roles:
            assert f"--{flag.name}" in text
            assert flag.env in text


def test_ignored_environment_variables_are_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    from shared.config import parse_settings

    env = {"HYBRID_PD_TP": "2", "HYBRID_PD_PREFIL": "x:1", "HYBRID_PD_PREFILL": "h:1", "HYBRID_PD_TEST_PAUSE": ""}
    settings = parse_settings("prefill", ["--port", "0"], environ=env)
    err = capsys.readouterr().err
    assert settings.tp == 2
    assert "prefill-svc: warning: HYBRID_PD_PREFIL is not a flag of prefill-svc (see --help); ignored" in err
    assert "prefill-svc: warning: HYBRID_PD_PREFILL is a decode-svc flag; prefill-svc ignores it" in err
    assert "HYBRID_PD_TP" not in err and "HYBRID_PD_TEST_PAUSE" not in err
    parse_settings("decode", ["--prefill", "h:1"], environ={"HYBRID_PD_TP": "1"})
    assert capsys.readouterr().err == ""  # nothing ignored, nothing said
