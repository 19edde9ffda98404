"""Two worker processes give exactly what one in-process replica gives: embeddings, scores and greedy text.

Each engine here starts real worker processes (as the server does), so batches are split between two
replicas with one thread each; results must still be bit-identical to the in-process engine's. The whole
parity suite also runs this way with `pytest tests/models --data-parallel-size 2`.
"""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams, RerankParams, SamplingParams


def _engine(model_dir, workers: int, **kwargs) -> SyncEngine:
    config = ModelConfig(path=str(model_dir), served_name="m", data_parallel_size=workers, warm_up=False, **kwargs)
    return SyncEngine(config, worker_processes=workers > 1)


def _embed_each(engine: SyncEngine, texts: list[str]) -> np.ndarray:
    results = engine.embed_concurrently([[t] for t in texts], EmbedParams(truncate=True))
    return np.concatenate([r.embeddings for r in results])


def test_two_workers_embed_and_rerank_exactly_as_one(bundled_dir, texts):
    """Batches of at most 4 sequences: the calls (all queued at once) make several batches to share out."""
    query, documents = texts[0][:200], [t[:300] for t in texts[1:13]]
    with _engine(bundled_dir, 1, max_batch_requests=4) as one:
        want = _embed_each(one, texts)
        want_ranking = one.rerank(query, documents, RerankParams(truncate=True)).results
    with _engine(bundled_dir, 2, max_batch_requests=4) as two:
        got = _embed_each(two, texts)
        got_ranking = two.rerank(query, documents, RerankParams(truncate=True)).results
        stats = two.worker_stats()
    assert np.array_equal(got, want), f"max difference {np.abs(got - want).max()}"
    assert got_ranking == want_ranking
    assert [s.index for s in stats] == [0, 1] and all(s.ready for s in stats)
    assert all(s.batches > 0 for s in stats), f"both workers should get batches: {stats}"
    assert len({s.pid for s in stats}) == 2


@pytest.mark.parametrize("arch", ["llama"])
def test_two_workers_generate_exactly_as_one(arch, tiny_generator, texts):
    model_dir = tiny_generator(arch)
    prompts = [" ".join(t.split()[:n]) for t, n in zip(texts[:8], [1, 3, 8, 20, 45, 70, 5, 12], strict=True)]
    params = [SamplingParams(max_tokens=16)] * len(prompts)
    seeded = [SamplingParams(max_tokens=16, temperature=0.8, seed=7)] * len(prompts)
    with _engine(model_dir, 1, max_batch_tokens=64) as one:
        want = [[t for d in deltas for t in d.token_ids] for deltas in one.generate_concurrently(prompts, params)]
        want_seeded = [[t for d in r for t in d.token_ids] for r in one.generate_concurrently(prompts, seeded)]
        blocks_one = one.kv_cache_usage().total_blocks
    with _engine(model_dir, 2, max_batch_tokens=64) as two:
        results = two.generate_concurrently(prompts, params)
        got_seeded = [[t for d in r for t in d.token_ids] for r in two.generate_concurrently(prompts, seeded)]
        usage = two.kv_cache_usage()
        stats = two.worker_stats()
    assert [[t for d in deltas for t in d.token_ids] for deltas in results] == want
    assert got_seeded == want_seeded
    # Each worker has its own cache, the same size as the single replica's; both served streams.
    assert usage.total_blocks == 2 * blocks_one and usage.used_blocks == 0
    assert all(s.batches > 0 for s in stats), f"both workers should get streams: {stats}"
