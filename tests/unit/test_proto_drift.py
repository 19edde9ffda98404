"""The checked-in stubs (ours, server and client copies, and TEI's) are exactly what proto/generate.py makes
from the .proto files today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STUBS = ("embedserv_pb2.py", "embedserv_pb2.pyi", "embedserv_pb2_grpc.py")
# The server's copy and the client package's copy of ours, and TEI's (proto/tei/v1/tei.proto).
CHECKED_IN = [
    *(f"{folder}/{name}" for folder in ("embedserv/v1", "clients/python/embedserv_client/v1") for name in STUBS),
    *(f"embedserv/tei/v1/{name}" for name in ("tei_pb2.py", "tei_pb2.pyi", "tei_pb2_grpc.py")),
]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "proto" / "generate.py"), str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"proto/generate.py failed:\n{result.stdout}\n{result.stderr}"
    return out


@pytest.mark.parametrize("stub", CHECKED_IN)
def test_checked_in_stub_matches_generator(regenerated: Path, stub: str) -> None:
    checked_in = REPO_ROOT / stub
    fresh = regenerated / stub
    assert fresh.exists(), f"proto/generate.py did not write {stub}"
    assert checked_in.exists(), f"{stub} is missing: run `make proto` and commit the stubs"
    assert checked_in.read_bytes() == fresh.read_bytes(), (
        f"{stub} differs from what its .proto under proto/ generates: run `make proto` and commit the regenerated stubs"
    )
