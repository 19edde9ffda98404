"""Encoder-decoder models on CUDA in float32: T5 (relative position bias) and BART greedy generation, and
monoT5 rerank scores, equal the same engine's on the CPU (which tests/models checks against transformers),
per attention backend that can run them (sdpa, flex; varlen needs half precision and refuses T5).

The reference is our CPU run, not transformers on the GPU machine: its transformers (5.17 when first run)
loaded these test checkpoints differently from the 5.23 they were built and checked with (the
transformers scores changed from one run to the next on the same seed, as if a tensor were initialized
at load), so it could not tell our CUDA path's errors from its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import RerankParams, SamplingParams
from tests.helpers.seq2seq_models import build_tiny_bart, build_tiny_monot5, build_tiny_t5
from tests.models.test_seq2seq_prefill import QUERY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)"),
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    lengths = [1, 2, 3, 5, 8, 12, 17, 25, 33, 45, 60, 90]
    return [" ".join(text.split()[:n]) for text, n in zip(stdlib_texts(12, seed=5), lengths, strict=True)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seq2seq-cuda")
    return {
        "t5": build_tiny_t5(tmp, variant="v1.1", tied=False),
        "bart": build_tiny_bart(tmp, max_position_embeddings=256),
        "monot5": build_tiny_monot5(tmp),
    }


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("name", ["t5", "bart"])
def test_seq2seq_greedy_generation_on_cuda_equals_cpu(name, backend, models, prompts):
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts)
    outputs = {}
    for device in ("cpu", "cuda"):
        config = ModelConfig(path=str(models[name]), served_name="m", device=device, attention_backend=backend)
        with SyncEngine(config) as engine:
            results = engine.generate_concurrently(prompts, params)
        outputs[device] = [[t for d in r for t in d.token_ids] for r in results]
    assert len({tuple(o) for o in outputs["cpu"]}) > 6, "random outputs should differ between prompts"
    assert outputs["cuda"] == outputs["cpu"]


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_monot5_rerank_on_cuda_equals_cpu(backend, models):
    documents = [f"document number {i} " * (1 + i) for i in range(10)]
    scores = {}
    for device in ("cpu", "cuda"):
        config = ModelConfig(path=str(models["monot5"]), served_name="m", device=device, attention_backend=backend)
        with SyncEngine(config) as engine:
            raw = engine.rerank(QUERY, documents, RerankParams(raw_scores=True))
        scores[device] = np.array([r.score for r in sorted(raw.results, key=lambda r: r.index)])
    np.testing.assert_allclose(scores["cuda"], scores["cpu"], atol=1e-4, rtol=0)
