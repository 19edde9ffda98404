"""`make -n` (a dry run: nothing runs, nothing installs) shows the variables a newcomer sets reaching the commands:
TORCH_INDEX_URL for the CPU torch wheel, METRICS_PORT for /metrics, and today's plain install when unset; and the
recipes may write bytecode."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers.server import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="`make` is not installed on this machine")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _dry_run(target: str, *variables: str) -> str:
    # -B: every recipe is printed, whether or not this checkout has a .venv already.
    done = subprocess.run(
        ["make", "-n", "-B", target, *variables], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.replace("\\\n", " ").split())


@pytest.mark.parametrize("target", ["serve", "test"])
def test_torch_comes_from_the_configured_index_unless_torch_index_url_is_given(target):
    # --no-compile: Python compiles a module when it is first imported (the Makefile lets it write bytecode).
    assert "pip install --no-compile torch==2.13.0" in _dry_run(target)
    assert "--index-url" not in _dry_run(target)
    with_index = _dry_run(target, f"TORCH_INDEX_URL={CPU_INDEX}")
    assert f"pip install --no-compile --index-url {CPU_INDEX} torch==2.13.0" in with_index


@pytest.mark.parametrize("target", ["serve", "test"])
def test_uv_installs_the_project_held_to_the_installed_torch_and_pip_takes_over_where_it_cannot(target):
    """uv (put into .venv by pip) installs the project and its extras, constrained to the torch build pip installed,
    so it never fetches another; where uv fails, pip installs the same; INSTALLER=pip leaves uv out."""
    commands = _dry_run(target)
    assert "print('torch==' + torch.__version__)\" > .venv/torch-pin.txt" in commands
    assert ".venv/bin/pip install --no-compile -q uv" in commands
    extras = "-e '.[test]' -e clients/python" if target == "test" else "-e ."
    uv = f".venv/bin/uv pip install --python .venv/bin/python --constraint .venv/torch-pin.txt {extras}"
    assert f"{uv} || {{" in commands and f".venv/bin/pip install --no-compile {extras};" in commands
    with_pip = _dry_run(target, "INSTALLER=pip")
    assert "uv" not in with_pip.replace("uvicorn", "")
    assert f".venv/bin/pip install --no-compile {extras}" in with_pip


def test_serve_exposes_metrics_on_9090_unless_metrics_port_says_otherwise():
    assert "embedserv serve --host 127.0.0.1 --port 50051 --http-port 8000 --metrics-port 9090" in _dry_run("serve")
    assert "--metrics-port 9555" in _dry_run("serve", "METRICS_PORT=9555")
    assert "--metrics-port" not in _dry_run("serve", "METRICS_PORT=0")


def test_recipes_may_write_bytecode_whatever_the_environment_says():
    """Installed without pip's compilation, modules are compiled by their first import; a PYTHONDONTWRITEBYTECODE
    from the caller would make every process compile them again."""
    check = 'bytecode-check: ; @python3 -c "import sys; print(sys.dont_write_bytecode)"'
    done = subprocess.run(
        ["make", "-s", f"--eval={check}", "bytecode-check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
