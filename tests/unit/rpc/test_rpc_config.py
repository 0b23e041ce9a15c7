"""Service settings: flag > env > default, validation naming the flag and the source."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefill_svc.http_api import advertised_address
from shared.config import FLAGS, Role, build_parser, parse_settings


def test_defaults() -> None:
    s = parse_settings("prefill", [], environ={})
    assert (s.model, s.tp, s.device, s.engine, s.port, s.kernel_block_size) == ("tiny-mamba2", 1, "cpu", "reference", 50051, 16)
    assert s.num_blocks is None and s.memory_budget is None  # sized from the model at start
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
    s = parse_settings("prefill", ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(cert)], environ={})
    assert s.tls.client_ca == cert and s.tls.ca is None  # mutual TLS without a client trust root
    with pytest.raises(SystemExit):
        parse_settings("prefill", [], environ={"HYBRID_PD_TLS_CLIENT_CA": str(cert)})
    assert "--tls-client-ca needs --tls-cert and --tls-key too" in capsys.readouterr().err


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
    # Ours but not flags: CI's switch and the checkpoint cache (a warning would break JSON logs).
    env |= {"HYBRID_PD_CI": "1", "HYBRID_PD_CACHE": "/somewhere", "HYBRID_PD_TEST_FAIL": "", "HYBRID_PD_TEST_CORRUPT": ""}
    settings = parse_settings("prefill", ["--port", "0"], environ=env)
    err = capsys.readouterr().err
    assert settings.tp == 2
    assert "prefill-svc: warning: HYBRID_PD_PREFIL is not a flag of prefill-svc (see --help); ignored" in err
    assert "prefill-svc: warning: HYBRID_PD_PREFILL is a decode-svc flag; prefill-svc ignores it" in err
    assert "HYBRID_PD_TP" not in err and "HYBRID_PD_TEST_PAUSE" not in err
    assert "HYBRID_PD_CI" not in err and "HYBRID_PD_CACHE" not in err
    assert "HYBRID_PD_TEST_FAIL" not in err and "HYBRID_PD_TEST_CORRUPT" not in err  # the fault seam's (TEST-ONLY)
    parse_settings("decode", ["--prefill", "h:1"], environ={"HYBRID_PD_TP": "1"})
    assert capsys.readouterr().err == ""  # nothing ignored, nothing said


@pytest.mark.parametrize(
    ("role", "argv", "flag", "owner"),
    [
        ("decode", ["--prefill", "h:1", "--lease-seconds", "3"], "--lease-seconds", "prefill"),
        ("decode", ["--prefill", "h:1", "--heartbeat-seconds=2"], "--heartbeat-seconds", "prefill"),
        ("prefill", ["--check-state"], "--check-state", "decode"),
        ("prefill", ["--prefill", "h:1"], "--prefill", "decode"),
        ("prefill", ["--read-timeout-seconds", "3"], "--read-timeout-seconds", "decode"),
    ],
)
def test_each_service_refuses_the_others_flags(
    capsys: pytest.CaptureFixture[str], role: str, argv: list[str], flag: str, owner: str
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_settings(role, argv, environ={})  # type: ignore[arg-type]
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"{role}-svc: error: {flag} is a {owner}-svc flag; {role}-svc does not take it"


def test_decode_threads_is_a_decode_flag_of_one_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_settings("decode", [], environ={}).decode_threads == 1
    assert parse_settings("decode", ["--decode-threads", "2"], environ={}).decode_threads == 2
    assert parse_settings("decode", [], environ={"HYBRID_PD_DECODE_THREADS": "3"}).decode_threads == 3
    assert parse_settings("prefill", [], environ={}).decode_threads == 1
    with pytest.raises(SystemExit):
        parse_settings("decode", ["--decode-threads", "0"], environ={})
    assert "--decode-threads = '0': must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--decode-threads", "2"], environ={})
    assert "--decode-threads is a decode-svc flag" in capsys.readouterr().err


def test_prefill_threads_is_a_prefill_flag_of_one_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_settings("prefill", [], environ={}).prefill_threads == 1
    assert parse_settings("prefill", ["--prefill-threads", "2"], environ={}).prefill_threads == 2
    assert parse_settings("prefill", [], environ={"HYBRID_PD_PREFILL_THREADS": "3"}).prefill_threads == 3
    assert parse_settings("decode", [], environ={}).prefill_threads == 1
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--prefill-threads", "0"], environ={})
    assert "--prefill-threads = '0': must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings("decode", ["--prefill-threads", "2"], environ={})
    assert "--prefill-threads is a prefill-svc flag" in capsys.readouterr().err


def test_flags_both_services_take_are_accepted_by_both() -> None:
    """Negative control of the refusal: shared flags pass, and one-role flags keep their role."""
    s = parse_settings("decode", ["--prefill", "h:1", "--max-pinned-requests", "8", "--drain-seconds", "2"], environ={})
    assert (s.max_pinned_requests, s.drain_seconds, s.heartbeat_seconds) == (8, 2.0, 5.0)
    s = parse_settings("prefill", ["--lease-seconds", "3", "--heartbeat-seconds", "2"], environ={})
    assert (s.lease_seconds, s.heartbeat_seconds) == (3.0, 2.0)
    roles = {f.name: f.roles for f in FLAGS}
    assert roles["lease-seconds"] == roles["heartbeat-seconds"] == ("prefill",)
    assert roles["check-state"] == roles["read-timeout-seconds"] == roles["prefill"] == ("decode",)


def test_the_default_engine_follows_the_model(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text("{}")
    nemotron, other = tmp_path / "nemotron", tmp_path / "other"
    for directory, family in ((nemotron, "nemotron_h"), (other, "llama")):
        directory.mkdir()
        (directory / "config.json").write_text(f'{{"model_type": "{family}"}}')
    cases = {
        "tiny-mamba2": "reference",
        "tiny-gdn": "reference",
        "nemotron-3-nano-30b-a3b": "synthetic",
        str(config): "synthetic",  # a config.json alone has no weights
        str(tmp_path): "hf",  # a checkpoint directory of no family the paged engine computes
        str(nemotron): "paged",  # one of a family it computes
        str(other): "hf",
    }
    for model, engine in cases.items():
        s = parse_settings("prefill", ["--model", model], environ={})
        assert (s.engine, s.engine_from_model) == (engine, True), model
    # An explicit --engine (flag or env) wins over what the model implies.
    s = parse_settings("prefill", ["--model", "tiny-mamba2", "--engine", "synthetic"], environ={})
    assert (s.engine, s.engine_from_model) == ("synthetic", False)
    s = parse_settings("prefill", ["--model", "tiny-mamba2"], environ={"HYBRID_PD_ENGINE": "synthetic"})
    assert (s.engine, s.engine_from_model) == ("synthetic", False)


def test_start_up_says_which_engine_and_warns_of_a_default_synthetic_one() -> None:
    import logging

    from shared.runtime.engine_host import engine_line

    level, line = engine_line(parse_settings("prefill", ["--model", "nemotron-3-nano-30b-a3b"], environ={}), "nemotron")
    assert level == logging.WARNING and "byte patterns" in line and "chosen by --model" in line
    level, line = engine_line(parse_settings("prefill", ["--engine", "synthetic"], environ={}), "tiny-mamba2")
    assert level == logging.INFO and "byte patterns" in line and "chosen" not in line  # asked for: no warning
    level, line = engine_line(parse_settings("prefill", [], environ={}), "tiny-mamba2")
    assert level == logging.INFO and line.startswith("engine reference (chosen by --model")
    level, line = engine_line(parse_settings("prefill", ["--engine", "paged", "--model", "ckpt"], environ={}), "ckpt")
    assert level == logging.INFO and line == "engine paged: checkpoint ckpt; prefill threads 1"


@pytest.mark.parametrize(
    ("role", "argv", "said"),
    [
        ("prefill", ["--prefill-threads", "3"], "; prefill threads 3"),
        ("decode", ["--decode-threads", "2"], "; decode threads 2"),
        ("decode", [], "; decode threads 1"),
    ],
)
def test_start_up_line_says_the_paged_engines_threads_of_its_role(role: Role, argv: list[str], said: str) -> None:
    from shared.runtime.engine_host import engine_line

    _, line = engine_line(parse_settings(role, ["--engine", "paged", "--model", "ckpt", *argv], environ={}), "ckpt")
    line, _, kernel = line.partition("; decode kernels: ")
    assert line == "engine paged: checkpoint ckpt" + said  # only its own role's count
    assert bool(kernel) == (role == "decode")  # decode's line also says its kernels' path
    off = parse_settings(role, ["--engine", "paged", "--model", "ckpt", "--batch-invariant", "off", *argv], environ={})
    _, line = engine_line(off, "ckpt")
    line = line.partition("; decode kernels: ")[0]
    assert line.startswith("engine paged: checkpoint ckpt; batch invariance off:") and line.endswith(said)
    # Engines that compute on one thread say nothing of threads.
    _, line = engine_line(parse_settings(role, ["--engine", "hf", "--model", "ckpt"], environ={}), "ckpt")
    assert "threads" not in line


def test_the_boundary_defaults_to_full_for_hf_and_is_refused_where_the_engine_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for role in ("prefill", "decode"):
        assert parse_settings(role, ["--model", str(tmp_path)], environ={}).boundary == "full"
        assert parse_settings(role, [], environ={}).boundary == "n-1"
    s = parse_settings("decode", ["--model", str(tmp_path)], environ={"HYBRID_PD_BOUNDARY": "n-1"})
    assert s.boundary == "n-1"
    for argv, env, needle in (
        (["--boundary", "full"], {}, "--boundary = 'full' needs --engine hf or paged; the reference engine runs n-1 only"),
        (["--engine", "synthetic"], {"HYBRID_PD_BOUNDARY": "full"}, "--boundary (from HYBRID_PD_BOUNDARY) = 'full'"),
        (["--boundary", "n"], {}, "--boundary = 'n': must be one of n-1, full"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_settings("prefill", argv, environ=env)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err, argv


def test_manifest_part_tokens_need_the_chunks_they_space(capsys: pytest.CaptureFixture[str]) -> None:
    s = parse_settings("prefill", ["--prefill-chunk-tokens", "1024", "--manifest-part-tokens", "8192"], environ={})
    assert (s.prefill_chunk_tokens, s.manifest_part_tokens) == (1024, 8192)
    assert parse_settings("prefill", [], environ={}).manifest_part_tokens == 0
    with pytest.raises(SystemExit) as e:
        parse_settings("prefill", [], environ={"HYBRID_PD_MANIFEST_PART_TOKENS": "8192"})
    assert e.value.code == 2
    assert "--manifest-part-tokens needs --prefill-chunk-tokens > 0" in capsys.readouterr().err


def test_layer_parts_need_the_chunks_whose_last_they_split(capsys: pytest.CaptureFixture[str]) -> None:
    s = parse_settings("prefill", ["--prefill-chunk-tokens", "1024", "--layer-parts", "4"], environ={})
    assert (s.prefill_chunk_tokens, s.layer_parts) == (1024, 4)
    assert parse_settings("prefill", [], environ={}).layer_parts == 0
    assert parse_settings("decode", [], environ={}).layer_parts == 0
    with pytest.raises(SystemExit) as e:
        parse_settings("prefill", [], environ={"HYBRID_PD_LAYER_PARTS": "4"})
    assert e.value.code == 2
    assert "--layer-parts needs --prefill-chunk-tokens > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--prefill-chunk-tokens", "1024", "--layer-parts", "-1"], environ={})


def test_served_model_names_from_a_comma_list_repeated_flags_or_env() -> None:
    """vLLM's --served-model-name: both services, a comma-separated list, the flag repeated, or env;
    without it the one name is --model as given."""
    for role in ("prefill", "decode"):
        assert parse_settings(role, ["--model", "tiny-jamba"], environ={}).model_names == ("tiny-jamba",)
        s = parse_settings(role, ["--served-model-name", "a, b", "--served-model-name", "c,a"], environ={})
        assert s.model_names == ("a", "b", "c") and s.model == "tiny-mamba2"
        s = parse_settings(role, [], environ={"HYBRID_PD_SERVED_MODEL_NAME": "org/m,m"})
        assert s.model_names == ("org/m", "m")
