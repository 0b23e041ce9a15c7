"""Building the paged engine's C kernels: built once into the cache directory and found there
afterwards; a changed source builds anew; no compiler, or a source that does not compile, gives
None and a log line (the engine then runs its torch path), never an exception or a half-written
library."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest

from shared.engine.paged import native_library

SOURCE = "int answer(void) { return %d; }\n"


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HYBRID_PD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def _answer(library: ctypes.CDLL | None) -> int:
    assert library is not None
    return int(library.answer())


def test_built_once_and_found_afterwards(tmp_path: Path, own_cache: Path) -> None:
    source = tmp_path / "probe.c"
    source.write_text(SOURCE % 41)
    assert _answer(native_library.build(source)) == 41
    (built,) = own_cache.iterdir()
    stamp = built.stat().st_mtime_ns
    assert _answer(native_library.build(source)) == 41
    assert [p.name for p in own_cache.iterdir()] == [built.name] and built.stat().st_mtime_ns == stamp
    source.write_text(SOURCE % 42)  # a changed source: a new library beside the old one
    assert _answer(native_library.build(source)) == 42
    assert len(list(own_cache.iterdir())) == 2


def test_no_compiler_gives_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "probe.c"
    source.write_text(SOURCE % 1)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO):
        assert native_library.build(source) is None
    assert "no C compiler found" in caplog.text


def test_a_failed_build_gives_none_and_leaves_nothing(tmp_path: Path, own_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "broken.c"
    source.write_text("int answer(void) { return }\n")
    assert native_library.build(source) is None
    assert "building the broken kernel failed" in caplog.text and "error" in caplog.text
    assert list(own_cache.iterdir()) == []  # no partial file left behind


def test_a_changed_header_beside_the_source_builds_anew(tmp_path: Path, own_cache: Path) -> None:
    (tmp_path / "probe.c").write_text('#include "probe.h"\nint answer(void) { return VALUE; }\n')
    (tmp_path / "probe.h").write_text("#define VALUE 7\n")
    assert _answer(native_library.build(tmp_path / "probe.c")) == 7
    (tmp_path / "probe.h").write_text("#define VALUE 8\n")
    assert _answer(native_library.build(tmp_path / "probe.c")) == 8


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HYBRID_PD_CACHE": "/srv/hpd", "XDG_CACHE_HOME": "/xdg"}, "/srv/hpd/kernels"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/hybrid-pd/kernels"),
        ({"HOME": "/home/someone"}, "/home/someone/.cache/hybrid-pd/kernels"),
    ],
)
def test_kernels_live_under_the_same_root_as_the_checkpoints(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HYBRID_PD_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert str(native_library.cache_dir()) == expected
