"""Cross-layer KV sharing as a user sees it, on a tiny Gemma 4 whose last three layers read earlier layers'
KV: the same --kv-cache-memory holds twice the blocks of the same model without sharing; ListModels names
the shared layers and whether the skip is on; a yes/no reranker (softcapped logits) equals the model card's
scores with the skip on and off; prompts sharing a prefix reuse cached blocks (one table for layers of
both shapes) and still generate transformers' tokens; start-up refuses --kv-sharing-fast-prefill for a
model without shared layers, naming the flag."""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.models.loading.spec_reader import read_model_spec
from embedserv.types import RerankParams
from tests.helpers import gemma_models
from tests.helpers.scorers import qwen3_reranker_reference, qwen3_reranker_reference_logits
from tests.models.test_generate_parity import _check_greedy, hf_generations  # noqa: F401 (a fixture)

# Per token, the sliding layers keep 2 KV heads x 16 and the full ones 1 x 32: 32 values each, so a block
# of 16 tokens is 2 (K, V) x 16 x 32 x 4 bytes = 4 KiB a layer. Three writers of six: 12 KiB a block.
KV_MEMORY = 96 * 4096


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4-sharing")
    return {
        "shared": gemma_models.build_gemma4_lm(root),
        "unshared": gemma_models.build_gemma4_lm(root, num_kv_shared_layers=0),
    }


def test_shared_layers_leave_room_for_more_blocks_and_list_models_names_them(gemma4, engine_for):
    shared = engine_for(gemma4["shared"], kv_cache_memory=KV_MEMORY, kv_sharing_fast_prefill=True)
    unshared = engine_for(gemma4["unshared"], kv_cache_memory=KV_MEMORY)
    workers = len(shared.worker_stats())
    assert shared.kv_cache_usage().total_blocks == 96 // 3 * workers
    assert unshared.kv_cache_usage().total_blocks == 96 // 6 * workers
    assert shared.info.kv_shared_layers == ((3, 1), (4, 1), (5, 2))
    assert shared.info.kv_sharing_fast_prefill
    assert unshared.info.kv_shared_layers == () and not unshared.info.kv_sharing_fast_prefill


@pytest.mark.parametrize("fast_prefill", [False, True])
def test_a_softcapped_yes_no_reranker_matches_the_model_card(fast_prefill, gemma4, engine_for, tmp_path_factory):
    """Gemma's logits are capped before yes and no are compared; the skip runs the shared layers on each
    prompt's last token only."""
    model_dir = tmp_path_factory.mktemp("rr") / "gemma4-reranker"
    if not model_dir.exists():
        gemma_models.with_config(gemma4["shared"], model_dir)
    engine = engine_for(model_dir, kv_sharing_fast_prefill=fast_prefill)
    assert [t.value for t in engine.info.tasks] == ["rerank"]
    from benchmarks.corpus import stdlib_texts

    query = "how do I check whether a file is a zip archive"
    documents = [" ".join(t.split()[:40]) for t in stdlib_texts(8, seed=11)]
    scores = engine.rerank(query, documents, RerankParams(truncate=True))
    raw = engine.rerank(query, documents, RerankParams(truncate=True, raw_scores=True))
    ours = [np.array([r.score for r in sorted(res.results, key=lambda r: r.index)]) for res in (scores, raw)]
    np.testing.assert_allclose(ours[0], qwen3_reranker_reference(model_dir, query, documents), atol=1e-4)
    np.testing.assert_allclose(ours[1], qwen3_reranker_reference_logits(model_dir, query, documents), atol=1e-4)


def test_fast_prefill_is_refused_for_a_model_without_shared_layers(tiny_generator):
    config = ModelConfig(path=str(tiny_generator("llama")), served_name="m", kv_sharing_fast_prefill=True)
    with pytest.raises(ConfigError, match="--kv-sharing-fast-prefill: .* no layers that reuse"):
        read_model_spec(config)


def test_list_models_reports_the_shared_layers_and_the_skip():
    """The server's ModelInfo message and the client's ModelInfo carry (layer, source) pairs and the flag;
    a model without shared layers leaves kv_sharing unset."""
    from embedserv.server.grpc.inference import model_info
    from embedserv.types import ModelInfo, Task
    from embedserv_client.types import KvSharing
    from embedserv_client.types import ModelInfo as ClientModelInfo

    base = dict(
        name="m",
        tasks=(Task.GENERATE,),
        architecture="Gemma4ForCausalLM",
        is_causal=True,
        pooling="",
        dimension=0,
        max_input_tokens=64,
        prompt_names=(),
        dtype="float32",
        device="cpu",
        attention_backend="sdpa",
    )
    shared = model_info(ModelInfo(**base, kv_shared_layers=((4, 2), (5, 3)), kv_sharing_fast_prefill=True))
    assert [(s.layer, s.source_layer) for s in shared.kv_sharing.shared_layers] == [(4, 2), (5, 3)]
    assert shared.kv_sharing.fast_prefill
    assert ClientModelInfo.from_proto(shared).kv_sharing == KvSharing(((4, 2), (5, 3)), True)
    plain = model_info(ModelInfo(**base))
    assert not plain.HasField("kv_sharing") and ClientModelInfo.from_proto(plain).kv_sharing is None


def test_skip_on_and_off_score_within_1e_5(gemma4, engine_for, tmp_path_factory):
    """The same reranker with and without the skip: raw yes/no logits within 1e-5 of each other."""
    from benchmarks.corpus import stdlib_texts

    model_dir = tmp_path_factory.mktemp("rr-both") / "gemma4-reranker"
    gemma_models.with_config(gemma4["shared"], model_dir)
    query = "which module parses command line arguments"
    documents = [" ".join(t.split()[:60]) for t in stdlib_texts(12, seed=12)]
    raw = []
    for fast_prefill in (False, True):
        result = engine_for(model_dir, kv_sharing_fast_prefill=fast_prefill).rerank(
            query, documents, RerankParams(truncate=True, raw_scores=True)
        )
        raw.append(np.array([r.score for r in sorted(result.results, key=lambda r: r.index)]))
    assert raw[0].std() > 0.01
    np.testing.assert_allclose(raw[1], raw[0], rtol=0, atol=1e-5)


def test_prompts_sharing_a_cached_prefix_generate_as_transformers(gemma4, engine_for, hf_generations):
    """One block table serves Gemma 4's layers of both shapes, so prefix caching stays on: prompts that
    start with the same 60 words reuse each other's blocks (windows and shared layers included), with the
    skip on, and still generate transformers' tokens."""
    from benchmarks.corpus import stdlib_texts

    shared = " ".join(" ".join(stdlib_texts(8, seed=9)).split()[:60])
    prompts = [f"{shared} {tail}" for tail in ("alpha", "beta gamma", "delta epsilon zeta", "eta")]
    expected = hf_generations(gemma4["shared"], prompts)
    engine = engine_for(gemma4["shared"], enable_prefix_caching=True, kv_sharing_fast_prefill=True)
    before = engine.kv_cache_usage().cached_prompt_tokens
    _check_greedy(engine, prompts[:1], expected[:1])
    _check_greedy(engine, prompts, expected)
    assert engine.kv_cache_usage().cached_prompt_tokens - before >= 4 * 16, "the shared blocks should be reused"
