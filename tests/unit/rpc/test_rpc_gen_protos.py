"""scripts/gen_protos.py: committed stubs are fresh, and --check catches drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gen_protos.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_committed_stubs_are_fresh_and_stale_ones_are_named(tmp_path: Path) -> None:
    fresh = run("--check")
    assert fresh.returncode == 0, fresh.stderr
    copy = tmp_path / "pb"
    shutil.copytree(ROOT / "shared" / "pb", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "hybridpd" / "v1" / "layout_pb2.py").write_text("# edited by hand\n")
    (copy / "hybridpd" / "v1" / "decode_service_pb2.pyi").unlink()
    (copy / "stray_pb2.py").write_text("")
    stale = run("--check", "--out", str(copy))
    assert stale.returncode == 1
    assert "layout_pb2.py (differs)" in stale.stderr
    assert "decode_service_pb2.pyi (missing)" in stale.stderr
    assert "stray_pb2.py (not generated from protos/)" in stale.stderr


def test_imports_point_at_shared_pb_and_wire_names_are_untouched() -> None:
    grpc_stub = (ROOT / "shared/pb/hybridpd/v1/prefill_service_pb2_grpc.py").read_text()
    assert "from shared.pb.hybridpd.v1 import prefill_service_pb2" in grpc_stub
    assert "'/hybridpd.v1.PrefillService/Session'" in grpc_stub
    from shared.pb.hybridpd.v1 import prefill_service_pb2

    assert prefill_service_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name == "hybridpd.v1.PrefillService"
    assert prefill_service_pb2.Manifest.__module__ == "shared.pb.hybridpd.v1.prefill_service_pb2"
