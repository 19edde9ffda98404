"""A/B check of the embedding path between two checkouts: in-process engine throughput of one tree.

    python benchmarks/embed_ab.py TREE [float32|bfloat16] [ATTENTION_BACKEND] [TEXTS] [PASSES]

Imports embedserv from TREE (e.g. a `git worktree` of an older commit), embeds 1,000 real texts in
calls of 32 with the bundled all-MiniLM-L6-v2, and prints the best of 5 timed passes after a warm-up.
Run it alternately on the two trees: this machine drifts between runs. ATTENTION_BACKEND (e.g. sdpa or
cpu_varlen) forces one, to compare two backends in one tree the same way ("-": the default). TEXTS and
PASSES (1,000 and 5) shorten a run on a busy machine.
"""

import sys
import time

tree = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "float32"
attention_backend = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
num_texts = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
passes = int(sys.argv[5]) if len(sys.argv) > 5 else 5
sys.path.insert(0, tree)

import embedserv  # noqa: E402

if not embedserv.__file__.startswith(tree):
    sys.exit(f"imported embedserv from {embedserv.__file__}, not from {tree}")

from benchmarks.corpus import stdlib_texts  # noqa: E402
from embedserv.config import ModelConfig, bundled_model_path  # noqa: E402
from embedserv.engine.sync import SyncEngine  # noqa: E402
from embedserv.types import EmbedParams  # noqa: E402

texts = stdlib_texts(num_texts, seed=0)
calls = [texts[i : i + 32] for i in range(0, len(texts), 32)]
config = ModelConfig(path=str(bundled_model_path()), served_name="m", dtype=dtype, attention_backend=attention_backend)
with SyncEngine(config) as engine:
    engine.embed_concurrently(calls, EmbedParams(truncate=True))
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        engine.embed_concurrently(calls, EmbedParams(truncate=True))
        best = min(best, time.perf_counter() - start)
print(f"{tree} {dtype} {attention_backend or 'default'} attention: {len(texts) / best:.1f} texts/s")
