"""A/B check of the embedding path between two checkouts: in-process engine throughput of one tree.

    python benchmarks/embed_ab.py TREE [float32|bfloat16]

Imports embedserv from TREE (e.g. a `git worktree` of an older commit), embeds 1,000 real texts in
calls of 32 with the bundled all-MiniLM-L6-v2, and prints the best of 5 timed passes after a warm-up.
Run it alternately on the two trees: this machine drifts between runs.
"""

import sys
import time

tree = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
sys.path.insert(0, tree)

import embedserv  # noqa: E402

if not embedserv.__file__.startswith(tree):
    sys.exit(f"imported embedserv from {embedserv.__file__}, not from {tree}")

from benchmarks.corpus import stdlib_texts  # noqa: E402
from embedserv.config import ModelConfig, bundled_model_path  # noqa: E402
from embedserv.engine.sync import SyncEngine  # noqa: E402
from embedserv.types import EmbedParams  # noqa: E402

texts = stdlib_texts(1000, seed=0)
calls = [texts[i : i + 32] for i in range(0, len(texts), 32)]
with SyncEngine(ModelConfig(path=str(bundled_model_path()), served_name="m", dtype=dtype)) as engine:
    engine.embed_concurrently(calls, EmbedParams(truncate=True))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        engine.embed_concurrently(calls, EmbedParams(truncate=True))
        best = min(best, time.perf_counter() - start)
print(f"{tree} {dtype}: {len(texts) / best:.1f} texts/s")
