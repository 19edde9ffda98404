"""The checked-in stubs are exactly what proto/generate.py makes from the .proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STUBS = ("embedserv_pb2.py", "embedserv_pb2.pyi", "embedserv_pb2_grpc.py")


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
    return out / "embedserv" / "v1"


@pytest.mark.parametrize("name", STUBS)
def test_checked_in_stub_matches_generator(regenerated: Path, name: str) -> None:
    checked_in = REPO_ROOT / "embedserv" / "v1" / name
    fresh = regenerated / name
    assert fresh.exists(), f"proto/generate.py did not write {name}"
    assert checked_in.exists(), f"embedserv/v1/{name} is missing: run `make proto` and commit the stubs"
    assert checked_in.read_bytes() == fresh.read_bytes(), (
        f"embedserv/v1/{name} differs from what proto/embedserv/v1/embedserv.proto generates: "
        "run `make proto` and commit the regenerated stubs"
    )
