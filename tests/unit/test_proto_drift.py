"""The checked-in stubs (server and client copies) are exactly what proto/generate.py makes from the .proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STUBS = ("embedserv_pb2.py", "embedserv_pb2.pyi", "embedserv_pb2_grpc.py")
# The server's copy and the client package's copy.
FOLDERS = ("embedserv/v1", "clients/python/embedserv_client/v1")


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


@pytest.mark.parametrize("folder", FOLDERS)
@pytest.mark.parametrize("name", STUBS)
def test_checked_in_stub_matches_generator(regenerated: Path, folder: str, name: str) -> None:
    checked_in = REPO_ROOT / folder / name
    fresh = regenerated / folder / name
    assert fresh.exists(), f"proto/generate.py did not write {folder}/{name}"
    assert checked_in.exists(), f"{folder}/{name} is missing: run `make proto` and commit the stubs"
    assert checked_in.read_bytes() == fresh.read_bytes(), (
        f"{folder}/{name} differs from what proto/embedserv/v1/embedserv.proto generates: "
        "run `make proto` and commit the regenerated stubs"
    )
