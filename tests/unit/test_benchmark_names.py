"""A benchmark script runs with benchmarks/ first on sys.path, and inductor hands sys.path to the Python
processes it starts (its vector-ISA probe): a benchmark named after a standard-library module
(benchmarks/encodings.py did) broke those interpreters at start-up, so every compiled int8 kernel of a
benchmark run failed to build and ran eagerly."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_no_benchmark_shadows_a_standard_library_module():
    names = {path.stem for path in BENCHMARKS.glob("*.py")}
    names |= {path.name for path in BENCHMARKS.iterdir() if path.is_dir()}
    assert names, "no benchmarks found"
    assert not sorted(names & sys.stdlib_module_names)
