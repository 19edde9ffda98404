"""Gemma 3 and Gemma 4 causal LMs equal transformers (float32) on prompts far longer than their windows.

Tiny random-weight models (tests/helpers/gemma_models.py): Gemma 3 with sliding windows of 12 tokens,
Gemma 4 with windows of 10, its last three layers reading earlier layers' KV, and per-layer head sizes.
Greedy generation equals transformers' generate token for token for twelve concurrent prompts, with
chunked prefill and under preemption (Gemma 4 also with --kv-sharing-fast-prefill); the logits of a
KV-free packed forward through our LM head (softcapping included) are within 1e-4 of transformers'.
Start-up refuses MoE Gemma 4, and only the layers that write KV own a cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedserv.attention.layer import attention_layers
from embedserv.attention.metadata import build_common_metadata
from embedserv.attention.selector import backend_class
from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.forward_context import set_forward_context
from embedserv.models import registry
from embedserv.models.heads.lm import SoftcappedLMHead, build_lm_head
from embedserv.models.loading.checkpoint import checkpoint_files
from embedserv.models.loading.hf_config import read_hf_config
from embedserv.models.loading.spec_reader import read_model_spec
from embedserv.models.loading.weights import build_model
from embedserv.worker.layer_routes import forward_context_for
from tests.helpers import gemma_models
from tests.helpers.models import load_in_process
from tests.models.test_generate_parity import _check_greedy, hf_generations  # noqa: F401 (a fixture)

CPU = torch.device("cpu")
ATOL = 1e-4
# (model, ModelConfig overrides): --kv-sharing-fast-prefill only means something for Gemma 4.
ENGINES = [
    pytest.param("gemma3", {}, id="gemma3"),
    pytest.param("gemma4", {}, id="gemma4"),
    pytest.param("gemma4", {"kv_sharing_fast_prefill": True}, id="gemma4-fast-prefill"),
]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Twelve prompts of 10 to 60 words (19 to 128 tokens): every one passes the windows."""
    from benchmarks.corpus import stdlib_texts

    texts = iter(t for t in stdlib_texts(200, seed=5) if len(t.split()) >= 80)
    lengths = [10, 12, 15, 18, 22, 27, 33, 40, 45, 50, 55, 60]
    return [" ".join(next(texts).split()[:n]) for n in lengths]


@pytest.fixture(scope="module")
def gemma_lm(tmp_path_factory):
    """gemma_lm("gemma3" | "gemma4") -> model dir, built once in the module."""
    root = tmp_path_factory.mktemp("gemma-lm")
    builders = {"gemma3": gemma_models.build_gemma3_lm, "gemma4": gemma_models.build_gemma4_lm}
    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = builders[name](root)
        return built[name]

    return get


def _kv_layout(model_dir, block_size: int = 16) -> tuple[int, int]:
    """(bytes of one KV-cache block over every layer that owns a cache (float32), KV-cache groups: one,
    whatever the layers' shapes)."""
    hf_config = read_hf_config(model_dir)
    with torch.device("meta"):
        model = registry.lookup(hf_config.model_type).model_class(hf_config)
    owners = [layer for layer in attention_layers(model) if layer.owns_kv_cache]
    block_bytes = sum(2 * block_size * layer.num_kv_heads * layer.head_size * 4 for layer in owners)
    return block_bytes, len({layer.kv_group for layer in owners})


def _prompt_ids(model_dir, prompts) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [torch.tensor(tokenizer(p)["input_ids"]) for p in prompts]


@pytest.mark.parametrize(("name", "options"), ENGINES)
def test_greedy_matches_transformers_for_concurrent_prompts(
    name, options, gemma_lm, engine_for, prompts, hf_generations
):
    model_dir = gemma_lm(name)
    window = read_hf_config(model_dir).sliding_window
    assert min(len(ids) for ids in _prompt_ids(model_dir, prompts)) > window, "every prompt must pass the window"
    expected = hf_generations(model_dir, prompts)
    assert len({tuple(e) for e in expected}) > 6, "random outputs should differ between prompts"
    # A 64-token budget splits the longer prompts over several steps (chunked prefill).
    engine = engine_for(model_dir, max_batch_tokens=64, **options)
    _check_greedy(engine, prompts, expected)
    assert engine.kv_cache_usage().used_blocks == 0


@pytest.mark.parametrize(("name", "options"), ENGINES)
def test_greedy_matches_transformers_under_preemption(name, options, gemma_lm, engine_for, prompts, hf_generations):
    model_dir = gemma_lm(name)
    expected = hf_generations(model_dir, prompts)
    # 16 blocks of 16 tokens: enough for the longest prompt (128 tokens) with its outputs, well under what
    # twelve prompts need together.
    block_bytes, groups = _kv_layout(model_dir)
    engine = engine_for(model_dir, kv_cache_memory=16 * block_bytes, **options)
    # Each worker has its own cache, each group its own 16 blocks.
    assert engine.kv_cache_usage().total_blocks == 16 * groups * len(engine.worker_stats())
    _check_greedy(engine, prompts, expected)
    usage = engine.kv_cache_usage()
    assert usage.preemptions > 0, "the cache should have been too small for all prompts at once"
    assert usage.used_blocks == 0


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_logits_match_transformers(name, backend, gemma_lm, prompts):
    """One KV-free packed forward of all prompts, through the softcapped LM head."""
    from transformers import AutoModelForCausalLM

    model_dir = gemma_lm(name)
    hf_config = read_hf_config(model_dir)
    files = checkpoint_files(model_dir)
    family = registry.lookup(hf_config.model_type)
    model = build_model(family, hf_config, files, CPU, torch.float32)
    head = build_lm_head(family, hf_config, files, CPU, torch.float32)
    assert isinstance(head, SoftcappedLMHead) and head.cap == gemma_models.SOFTCAP

    sequences = _prompt_ids(model_dir, prompts)
    lengths = [len(s) for s in sequences]
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(n) for n in lengths])
    attn = backend_class(backend)()
    metadata = attn.build_metadata(build_common_metadata(np.array(lengths), is_causal=True))
    with torch.inference_mode(), set_forward_context(forward_context_for(model, attn, metadata)):
        logits = head(model(ids, positions))

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    with torch.inference_mode():
        for sequence, got in zip(sequences, logits.split(lengths), strict=True):
            expected = reference(input_ids=sequence[None]).logits[0]
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert logits.abs().max() < gemma_models.SOFTCAP


def test_moe_gemma4_is_refused_at_start_up(gemma_lm, tmp_path):
    model_dir = gemma_models.with_config(
        gemma_lm("gemma4"),
        tmp_path / "moe",
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    )
    with pytest.raises(ConfigError) as err:
        read_model_spec(ModelConfig(path=str(model_dir), served_name="m"))
    assert str(model_dir) in str(err.value) and "MoE Gemma 4" in str(err.value)


def test_only_layers_that_write_kv_own_a_cache(gemma_lm):
    """Layers 3-5 read layers 1, 1 and 2: the cache has tensors for layers 0-2 only, in one group (one block
    table) although the sliding layers keep 2 KV heads of 16 and the full layer 1 of 32."""
    runner = load_in_process(ModelConfig(path=str(gemma_lm("gemma4")), served_name="m", kv_cache_memory=1 << 20))
    layers = attention_layers(runner.model)
    assert [layer.kv_source_layer for layer in layers] == [None, None, None, 1, 1, 2]
    assert [layer.kv_group for layer in layers] == [0] * 6
    assert runner.model.prefill_skip_layer == 3
    tensors = runner.kv_cache.tensors
    assert [t is not None for t in tensors] == [True, True, True, False, False, False]
    assert [group.layers for group in runner.kv_cache.groups] == [(0, 1, 2)]
    assert tensors[0].shape[-2:] == (2, 16) and tensors[2].shape[-2:] == (1, 32)
