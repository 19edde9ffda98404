"""Encoder-decoder greedy generation equals transformers' generate token for token (float32).

Small random-weight T5 (v1.0 relu and v1.1 gated-gelu, tied and untied heads), mT5, BART and mBART models
built in the test with trained tokenizers. A dozen prompts of mixed encoder lengths go in at once; the
encoder of each runs once, in its request's first step, and writes the cross-attention KV cache that every
later step reads. Also with a decoder prompt split over steps (chunked decoder prefill), and with a KV cache
so small that requests are preempted and recomputed (the test counts the preemptions).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv.types import SamplingParams
from tests.helpers.seq2seq_models import build_tiny_bart, build_tiny_t5

MAX_TOKENS = 16
# name -> builder keyword arguments. A tied T5 scales its output by d_model**-0.5: with the builder's
# initializer_factor of 1 its random generations all collapse onto one token, so those get wider weights.
VARIANTS = {
    "t5-v1.0-tied": dict(kind="t5", variant="v1.0", tied=True, initializer_factor=2.0),
    "t5-v1.0-untied": dict(kind="t5", variant="v1.0", tied=False),
    "t5-v1.1-tied": dict(kind="t5", variant="v1.1", tied=True, initializer_factor=2.0),
    "t5-v1.1-untied": dict(kind="t5", variant="v1.1", tied=False),
    "mt5": dict(kind="t5", variant="v1.1", tied=False, mt5=True),
    # Room for the longest prompt's ~150 byte-level tokens and the outputs.
    "bart": dict(kind="bart", max_position_embeddings=256),
    "mbart": dict(kind="bart", mbart=True, max_position_embeddings=256),
}
# transformers' generate exactly as greedy search, none of the configs' generation extras.
_GREEDY = dict(
    num_beams=1,
    do_sample=False,
    forced_bos_token_id=None,
    forced_eos_token_id=None,
    no_repeat_ngram_size=0,
    min_length=0,
    repetition_penalty=1.0,
    length_penalty=1.0,
)


@pytest.fixture(scope="module")
def seq2seq_dir(tmp_path_factory):
    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            kwargs = dict(VARIANTS[name])
            kind = kwargs.pop("kind")
            tmp = tmp_path_factory.mktemp(name)
            built[name] = build_tiny_t5(tmp, **kwargs) if kind == "t5" else build_tiny_bart(tmp, **kwargs)
        return built[name]

    return get


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Twelve prompts from 1 to about 90 words: encoder inputs of mixed lengths."""
    texts = stdlib_texts(12, seed=5)
    lengths = [1, 2, 3, 5, 8, 12, 17, 25, 33, 45, 60, 90]
    return [" ".join(text.split()[:n]) for text, n in zip(texts, lengths, strict=True)]


_REFERENCE: dict[tuple, list[list[int]]] = {}


def hf_generate(model_dir, prompts: list[str], decoder_prompts: list[str] | None = None) -> list[list[int]]:
    """New token ids per prompt from transformers' greedy generate, one prompt at a time (no padding)."""
    key = (str(model_dir), tuple(prompts), tuple(decoder_prompts or ()))
    if key in _REFERENCE:
        return _REFERENCE[key]
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSeq2SeqLM.from_pretrained(str(model_dir), attn_implementation="eager").float().eval()
    start = model.config.decoder_start_token_id
    out = []
    with torch.no_grad():
        for index, prompt in enumerate(prompts):
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            decoder = [start]
            if decoder_prompts:
                decoder += tokenizer(decoder_prompts[index], add_special_tokens=False).input_ids
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                decoder_input_ids=torch.tensor([decoder]),
                max_new_tokens=MAX_TOKENS,
                **_GREEDY,
            )
            out.append(generated[0, len(decoder) :].tolist())
    _REFERENCE[key] = out
    return out


def _check_greedy(engine, prompts, expected, decoder_prompts=None):
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts)
    results = engine.generate_concurrently(prompts, params, decoder_prompts=decoder_prompts)
    for prompt, deltas, want in zip(prompts, results, expected, strict=True):
        got = [t for d in deltas for t in d.token_ids]
        assert got == want, f"prompt {prompt[:40]!r}: ours {got} != transformers {want}"
        last = deltas[-1]
        assert last.finish_reason == ("length" if len(want) == MAX_TOKENS else "eos")
        assert last.completion_tokens == len(want)
    return results


@pytest.mark.parametrize("name", ["t5-v1.0-tied", "t5-v1.1-untied", "bart"])
def test_greedy_matches_transformers_for_concurrent_prompts(name, seq2seq_dir, engine_for, prompts):
    model_dir = seq2seq_dir(name)
    expected = hf_generate(model_dir, prompts)
    assert len({tuple(e) for e in expected}) > 6, "random outputs should differ between prompts"
    engine = engine_for(model_dir)
    results = _check_greedy(engine, prompts, expected)
    # Usage counts the encoder's tokens and the decoder's start token.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert results[-1][-1].prompt_tokens == len(tokenizer(prompts[-1]).input_ids) + 1
    assert engine.kv_cache_usage().used_blocks == 0


@pytest.mark.parametrize("name", ["t5-v1.0-untied", "t5-v1.1-tied", "mt5", "mbart"])
def test_greedy_matches_transformers_for_every_variant(name, seq2seq_dir, engine_for, prompts):
    model_dir = seq2seq_dir(name)
    chosen = prompts[::3]
    _check_greedy(engine_for(model_dir), chosen, hf_generate(model_dir, chosen))


@pytest.mark.parametrize("name", ["t5-v1.1-untied", "bart"])
def test_decoder_prompt_over_chunked_decoder_prefill(name, seq2seq_dir, engine_for, prompts):
    """A decoder prompt of up to 30 words under an 8-token step budget: the decoder prefill takes several
    steps; the encoder runs in the first only."""
    model_dir = seq2seq_dir(name)
    decoder_prompts = [" ".join(p.split()[:30][::-1]) for p in prompts]
    expected = hf_generate(model_dir, prompts, decoder_prompts)
    _check_greedy(engine_for(model_dir, max_batch_tokens=8), prompts, expected, decoder_prompts)


@pytest.mark.parametrize("name", ["t5-v1.0-tied", "bart"])
def test_greedy_matches_transformers_under_preemption(name, seq2seq_dir, engine_for, prompts):
    """Decoder prompts of 20 words make the decoder's tables grow while cross tables hold their blocks."""
    model_dir = seq2seq_dir(name)
    decoder_prompts = [" ".join(stdlib_texts(1, seed=30 + i)[0].split()[:20]) for i in range(len(prompts))]
    expected = hf_generate(model_dir, prompts, decoder_prompts)
    # A block id holds 4 tokens in each of the two groups (decoder self, cross), for 2 decoder layers:
    # 2 groups x 2 layers x (K, V) x 4 tokens x 64 floats x 4 bytes = 8 KiB. 40 of them hold the longest
    # prompt (about 38 cross blocks for BART's ~150 tokens) and its outputs, far from what twelve prompts
    # need together.
    engine = engine_for(model_dir, kv_cache_memory=40 * 8192, kv_block_size=4)
    assert engine.kv_cache_usage().total_blocks == 2 * 40 * len(engine.worker_stats())
    _check_greedy(engine, prompts, expected, decoder_prompts)
    usage = engine.kv_cache_usage()
    assert usage.preemptions > 0, "the cache should have been too small for all prompts at once"
    assert usage.used_blocks == 0


# Compiled flex on CPU costs half a minute here; it runs with --run-slow, and on CUDA in make gpu-check.
@pytest.mark.parametrize("backend", ["naive", pytest.param("flex", marks=pytest.mark.slow)])
def test_greedy_matches_with_other_backends(backend, seq2seq_dir, engine_for, prompts):
    """T5's relative position bias and cross attention through the oracle and FlexAttention (paged)."""
    if backend == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    model_dir = seq2seq_dir("t5-v1.1-untied")
    chosen = prompts[::2]
    _check_greedy(engine_for(model_dir, attention_backend=backend), chosen, hf_generate(model_dir, chosen))


def test_prefix_caching_does_not_share_decoder_blocks_across_encoder_inputs(seq2seq_dir, engine_for, prompts):
    """Identical decoder prompts after different encoder inputs: cached decoder blocks must not be reused
    across them (their keys depend on the encoder); the same encoder input twice may reuse them."""
    model_dir = seq2seq_dir("bart")
    decoder_prompt = " ".join(" ".join(stdlib_texts(4, seed=11)).split()[:40])
    chosen = [prompts[4], prompts[7]]
    expected = hf_generate(model_dir, chosen, [decoder_prompt] * 2)
    engine = engine_for(model_dir, enable_prefix_caching=True)
    before = engine.kv_cache_usage().cached_prompt_tokens
    _check_greedy(engine, chosen[:1], expected[:1], [decoder_prompt])
    _check_greedy(engine, chosen[1:], expected[1:], [decoder_prompt])
    assert engine.kv_cache_usage().cached_prompt_tokens == before, "different encoder inputs shared decoder blocks"
    _check_greedy(engine, chosen[:1], expected[:1], [decoder_prompt])
    assert engine.kv_cache_usage().cached_prompt_tokens > before, "the same encoder input should reuse its blocks"


def test_two_workers_generate_exactly_as_one(seq2seq_dir, prompts):
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    model_dir = seq2seq_dir("t5-v1.1-untied")
    params = [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts)
    outputs = []
    for workers in (1, 2):
        config = ModelConfig(
            path=str(model_dir), served_name="m", data_parallel_size=workers, max_batch_tokens=32, warm_up=False
        )
        with SyncEngine(config, worker_processes=workers > 1) as engine:
            results = engine.generate_concurrently(prompts, params)
            outputs.append([[t for d in r for t in d.token_ids] for r in results])
            if workers == 2:
                assert all(s.batches > 0 for s in engine.worker_stats()), "both workers should generate"
    assert outputs[0] == outputs[1] == hf_generate(model_dir, prompts)
