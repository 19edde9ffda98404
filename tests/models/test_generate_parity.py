"""Greedy generation equals transformers' generate token for token (float32), however the engine batches.

Small random-weight Llama and Qwen2 causal LMs built in the test. Twelve prompts of different lengths go in
at once (continuous batching, chunked prefill under a small token budget), and again with a KV cache so
small that requests are preempted and recomputed (in this process and in a worker process); the tests count
the preemptions.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv.types import SamplingParams

MAX_TOKENS = 24
ARCHS = ["llama", "qwen2"]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Twelve prompts from 1 to about 90 words."""
    texts = stdlib_texts(12, seed=3)
    lengths = [1, 2, 3, 5, 8, 12, 17, 25, 33, 45, 60, 90]
    return [" ".join(text.split()[:n]) for text, n in zip(texts, lengths, strict=True)]


@pytest.fixture(scope="module")
def hf_generations():
    """Factory: hf_generations(model_dir, prompts) -> new token ids per prompt from transformers' generate."""
    cache: dict[tuple, list[list[int]]] = {}

    def generate(model_dir, prompts, max_tokens=MAX_TOKENS):
        key = (str(model_dir), tuple(prompts), max_tokens)
        if key not in cache:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").float().eval()
            out = []
            with torch.no_grad():
                for prompt in prompts:
                    ids = tokenizer(prompt, return_tensors="pt").input_ids
                    generated = model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=max_tokens,
                        do_sample=False,
                    )
                    out.append(generated[0, ids.shape[1] :].tolist())
            cache[key] = out
        return cache[key]

    return generate


def _generated_ids(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _check_greedy(engine, prompts, expected):
    results = engine.generate_concurrently(prompts, [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts))
    for prompt, deltas, want in zip(prompts, results, expected, strict=True):
        got = _generated_ids(deltas)
        assert got == want, f"prompt {prompt[:40]!r}: ours {got} != transformers {want}"
        last = deltas[-1]
        assert last.finish_reason == ("length" if len(want) == MAX_TOKENS else "eos")
        assert last.completion_tokens == len(want)
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_for_concurrent_prompts(arch, tiny_generator, engine_for, prompts, hf_generations):
    model_dir = tiny_generator(arch)
    expected = hf_generations(model_dir, prompts)
    assert len({tuple(e) for e in expected}) > 6, "random outputs should differ between prompts"
    # A 64-token budget splits the longer prompts over several steps (chunked prefill).
    engine = engine_for(model_dir, max_batch_tokens=64)
    _check_greedy(engine, prompts, expected)
    assert engine.kv_cache_usage().used_blocks == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_under_preemption(arch, tiny_generator, engine_for, prompts, hf_generations):
    model_dir = tiny_generator(arch)
    expected = hf_generations(model_dir, prompts)
    # 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB a block: 16 blocks hold 256
    # tokens, enough for the longest prompt (qwen2's tokenizer makes ~190 tokens of it) with its outputs,
    # well under what twelve prompts need together.
    engine = engine_for(model_dir, kv_cache_memory=16 * 8192)
    # Each worker has its own cache (one in process; --data-parallel-size N gives N).
    assert engine.kv_cache_usage().total_blocks == 16 * len(engine.worker_stats())
    _check_greedy(engine, prompts, expected)
    usage = engine.kv_cache_usage()
    assert usage.preemptions > 0, "the cache should have been too small for all prompts at once"
    assert usage.used_blocks == 0


def test_greedy_matches_transformers_in_a_worker_process_under_preemption(tiny_generator, prompts, hf_generations):
    """The server's path: steps go to a worker process as deltas against the running batch it keeps
    (executor/step_delta.py), re-sent whole after each preemption; the in-process tests above run the same
    deltas without the codec."""
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    model_dir = tiny_generator("llama")
    expected = hf_generations(model_dir, prompts)
    config = ModelConfig(
        path=str(model_dir), served_name="m", dtype="float32", kv_cache_memory=16 * 8192, warm_up=False
    )
    with SyncEngine(config, worker_processes=True) as engine:
        _check_greedy(engine, prompts, expected)
        assert engine.kv_cache_usage().preemptions > 0
        _check_greedy(engine, prompts[::-1], expected[::-1])


def test_greedy_matches_with_tied_embeddings_and_backends(tiny_generator, engine_for, prompts, hf_generations):
    model_dir = tiny_generator("llama", tie_word_embeddings=True)
    expected = hf_generations(model_dir, prompts[:6])
    for backend in ("naive", "flex"):
        if backend == "flex":
            pytest.importorskip("torch.nn.attention.flex_attention")
        _check_greedy(engine_for(model_dir, attention_backend=backend), prompts[:6], expected)


def test_greedy_matches_when_prompts_share_a_cached_prefix(tiny_generator, engine_for, hf_generations):
    """Prompts that start with the same 60 words reuse each other's cached blocks; outputs do not change."""
    model_dir = tiny_generator("llama", seed=1)
    shared = " ".join(" ".join(stdlib_texts(8, seed=9)).split()[:60])
    prompts = [f"{shared} {tail}" for tail in ("alpha", "beta gamma", "delta epsilon zeta", "eta")]
    expected = hf_generations(model_dir, prompts)
    engine = engine_for(model_dir, enable_prefix_caching=True)
    before = engine.kv_cache_usage().cached_prompt_tokens
    _check_greedy(engine, prompts[:1], expected[:1])
    _check_greedy(engine, prompts, expected)
    assert engine.kv_cache_usage().cached_prompt_tokens - before >= 4 * 16, "the shared blocks should be reused"
    uncached = engine_for(model_dir, enable_prefix_caching=False)
    _check_greedy(uncached, prompts, expected)
    assert uncached.kv_cache_usage().cached_prompt_tokens == 0
