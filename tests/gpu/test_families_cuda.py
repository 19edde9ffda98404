"""Every model family, and the sparse, multi-vector, bge-m3, late-chunking, rerank and generation paths, on
CUDA against the same engine on the CPU (which tests/models checks against the reference libraries).

Each family is a small random-weight model from its test helper. Float32 on CUDA must equal float32 on the CPU
(cosine >= 0.9999 for vectors, 1e-4 for scores); bfloat16 on CUDA must stay near it (cosine >= 0.99), which
catches a wrong mask or a dropped sliding window (those move vectors far more) while allowing bf16 rounding on
random weights. Gemma 3/4 and ModernBERT carry sliding windows far below the inputs' lengths.

EMBEDSERV_GPU_TEST_DEVICE=cpu runs the module on the CPU against itself: a dry run of every builder and path.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import ChunkSplitter, EmbedOutput, EmbedParams, LateChunking, RerankParams, SamplingParams
from tests.helpers import gemma_models
from tests.helpers.classic_models import build_classic_cross_encoder, build_classic_encoder
from tests.helpers.compare import assert_cosine_at_least
from tests.helpers.deberta_models import build_deberta_embedder
from tests.helpers.models import build_tiny_decoder, build_tiny_encoder, build_tiny_generator
from tests.helpers.modernbert_models import build_eurobert_embedder, build_modernbert_embedder
from tests.helpers.multi_vector_models import build_multi_vector_encoder
from tests.helpers.rotary_encoder_models import build_rotary_encoder
from tests.helpers.sparse_models import build_bge_m3, build_splade_encoder

DEVICE = os.environ.get("EMBEDSERV_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.99}

DENSE = {
    "bert-cls": lambda tmp: build_tiny_encoder(tmp, "bert", "cls"),
    "xlm-roberta-mean": lambda tmp: build_tiny_encoder(tmp, "xlm-roberta", "mean"),
    "llama-lasttoken": lambda tmp: build_tiny_decoder(tmp, "llama", "lasttoken"),
    "qwen3-mean": lambda tmp: build_tiny_decoder(tmp, "qwen3", "mean"),
    "mistral-bidirectional": lambda tmp: build_tiny_decoder(tmp, "mistral", "mean", is_causal=False),
    "modernbert": lambda tmp: build_modernbert_embedder(tmp, "mean"),
    "eurobert": lambda tmp: build_eurobert_embedder(tmp, "mean"),
    "gte": lambda tmp: build_rotary_encoder(tmp, "gte", "cls"),
    "nomic-bert": lambda tmp: build_rotary_encoder(tmp, "nomic_bert", "mean"),
    "mpnet": lambda tmp: build_classic_encoder(tmp, "mpnet", "mean"),
    "distilbert": lambda tmp: build_classic_encoder(tmp, "distilbert", "mean"),
    "deberta-v3": lambda tmp: build_deberta_embedder(tmp, "v3", "mean"),
    "embeddinggemma": gemma_models.build_embeddinggemma,
    "gemma4-embedder": gemma_models.build_gemma4_embedder,
}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """24 real texts, some longer than the models' 128-token limit (truncated)."""
    return stdlib_texts(24, seed=4)


def _run(model_dir, device: str, dtype: str, call, **options):
    config = ModelConfig(path=str(model_dir), served_name="m", device=device, dtype=dtype, **options)
    with SyncEngine(config) as engine:
        assert engine.info.device.startswith(device), engine.info
        return call(engine)


def _on_both(model_dir, dtype: str, call, **options):
    """(the CPU's float32 result, the device's result in dtype)."""
    return _run(model_dir, "cpu", "float32", call, **options), _run(model_dir, DEVICE, dtype, call, **options)


@pytest.mark.parametrize("dtype", list(MIN_COSINE))
@pytest.mark.parametrize("family", list(DENSE))
def test_dense_embeddings_on_the_device_equal_the_cpu(family, dtype, texts, tmp_path):
    model_dir = DENSE[family](tmp_path)
    cpu, device = _on_both(model_dir, dtype, lambda e: e.embed(texts, EmbedParams(truncate=True)).embeddings)
    assert_cosine_at_least(device, cpu, MIN_COSINE[dtype], texts, what=f"{family} {DEVICE} {dtype}: ")


def _sparse_dense(vectors, size: int) -> np.ndarray:
    out = np.zeros((len(vectors), size), dtype=np.float32)
    for row, vector in enumerate(vectors):
        out[row, vector.indices] = vector.values
    return out


def test_splade_sparse_vectors_on_the_device_equal_the_cpu(texts, tmp_path):
    model_dir = build_splade_encoder(tmp_path, "bert", "max", "relu")
    params = EmbedParams(outputs=(EmbedOutput.SPARSE,), truncate=True)
    cpu, device = _on_both(model_dir, "float32", lambda e: e.embed(texts, params).sparse)
    size = 1 + max(int(v.indices.max(initial=0)) for v in cpu + device)
    np.testing.assert_allclose(_sparse_dense(device, size), _sparse_dense(cpu, size), atol=1e-3, rtol=1e-3)


def _assert_multi_vectors_close(device, cpu, texts, what: str, min_cosine: float = MIN_COSINE["float32"]) -> None:
    for text, ours, want in zip(texts, device, cpu, strict=True):
        assert ours.shape == want.shape, f"{what}{text[:40]!r}: {ours.shape} != {want.shape}"
        assert_cosine_at_least(ours, want, min_cosine, [text] * len(want), what=what)


def test_multi_vectors_on_the_device_equal_the_cpu(texts, tmp_path):
    model_dir = build_multi_vector_encoder(tmp_path)
    params = EmbedParams(outputs=(EmbedOutput.MULTI_VECTOR,), truncate=True)
    cpu, device = _on_both(model_dir, "float32", lambda e: e.embed(texts, params).multi_vectors)
    _assert_multi_vectors_close(device, cpu, texts, f"multi-vector {DEVICE}: ")


def test_bge_m3_heads_on_the_device_equal_the_cpu(texts, tmp_path):
    model_dir = build_bge_m3(tmp_path, head_format="safetensors")
    params = EmbedParams(outputs=(EmbedOutput.DENSE, EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR), truncate=True)
    cpu, device = _on_both(model_dir, "float32", lambda e: e.embed(texts, params))
    assert_cosine_at_least(device.embeddings, cpu.embeddings, MIN_COSINE["float32"], texts, what="bge-m3 dense: ")
    size = 1 + max(int(v.indices.max(initial=0)) for v in cpu.sparse + device.sparse)
    np.testing.assert_allclose(
        _sparse_dense(device.sparse, size), _sparse_dense(cpu.sparse, size), atol=1e-3, rtol=1e-3
    )
    _assert_multi_vectors_close(device.multi_vectors, cpu.multi_vectors, texts, "bge-m3 multi-vector: ")


def test_late_chunking_and_long_input_chunking_on_the_device_equal_the_cpu(texts, tmp_path):
    model_dir = build_tiny_encoder(tmp_path, "bert", "mean", max_seq_length=64)
    long_texts = [" ".join(texts[:6]), " ".join(texts[6:12])]

    def call(engine):
        late = EmbedParams(late_chunking=LateChunking(splitter=ChunkSplitter.TOKENS, chunk_tokens=24, overlap_tokens=4))
        windows = EmbedParams(truncate=False, chunking=True)
        return engine.embed(long_texts, late).chunks, engine.embed(long_texts, windows).embeddings

    (cpu_chunks, cpu_windows), (device_chunks, device_windows) = _on_both(model_dir, "float32", call)
    for (cpu_spans, cpu_vectors), (device_spans, device_vectors) in zip(cpu_chunks, device_chunks, strict=True):
        assert device_spans == cpu_spans
        assert_cosine_at_least(device_vectors, cpu_vectors, MIN_COSINE["float32"], list(map(str, cpu_spans)))
    assert_cosine_at_least(device_windows, cpu_windows, MIN_COSINE["float32"], long_texts)


def test_cross_encoder_scores_on_the_device_equal_the_cpu(texts, tmp_path):
    model_dir = build_classic_cross_encoder(tmp_path, "electra")

    def call(engine):
        raw = engine.rerank(" ".join(texts[0].split()[:12]), texts[1:], RerankParams(truncate=True, raw_scores=True))
        return np.array([r.score for r in sorted(raw.results, key=lambda r: r.index)])

    cpu, device = _on_both(model_dir, "float32", call)
    np.testing.assert_allclose(device, cpu, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("builder", ["gemma3", "gemma4"])
def test_gemma_sliding_window_generation_on_the_device_equals_the_cpu(builder, texts, tmp_path):
    """Greedy tokens of a Gemma 3 / 4 LM with sliding layers (window far below the prompts) in float32."""
    model_dir = getattr(gemma_models, f"build_{builder}_lm")(tmp_path)
    prompts = [" ".join(t.split()[:n]) for t, n in zip(texts[:5], [3, 10, 30, 60, 90], strict=True)]

    def call(engine):
        results = engine.generate_concurrently(prompts, [SamplingParams(max_tokens=12)] * len(prompts))
        return [[t for d in deltas for t in d.token_ids] for deltas in results]

    cpu, device = _on_both(model_dir, "float32", call)
    assert device == cpu


def test_llama_generation_on_the_device_in_bfloat16_starts_as_the_cpu(texts, tmp_path):
    model_dir = build_tiny_generator(tmp_path, "llama")
    prompts = [" ".join(t.split()[:n]) for t, n in zip(texts[:4], [2, 8, 20, 40], strict=True)]

    def call(engine):
        results = engine.generate_concurrently(prompts, [SamplingParams(max_tokens=4)] * len(prompts))
        return [[t for d in deltas for t in d.token_ids] for deltas in results]

    cpu, device = _on_both(model_dir, "bfloat16", call)
    assert sum(c[:1] == d[:1] for c, d in zip(cpu, device, strict=True)) >= len(prompts) - 1, (cpu, device)
