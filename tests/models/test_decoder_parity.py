"""Our engine (own Llama-family decoder, rotary, attention, pooling) equals the references on the same weights.

Small random-weight Llama, Mistral, Qwen2 and Qwen3 decoders (GQA: 4 query heads, 2 KV heads; Qwen3 with a
head size apart from hidden / heads) built from configs in the test, with last-token and mean pooling,
run in-process through SyncEngine. The oracle is sentence-transformers, float32 on CPU; for bidirectional
decoders also transformers itself with an explicit non-causal mask.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv.attention.layer import attention_layers
from embedserv.models.families.llama import LlamaModel
from embedserv.models.loading.hf_config import read_hf_config
from embedserv.types import EmbedParams
from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm, cosines, normalized
from tests.helpers.models import (
    DECODER_ARCHS,
    DECODER_POOLINGS,
    LINEAR_ROPE,
    LLAMA3_ROPE,
    reference_token_counts,
)

MAX_SEQ_LENGTH = 128
MIN_COSINE = 0.9999


def _check_parity(engine, st, texts, what: str, **params) -> np.ndarray:
    """Our embeddings of texts equal sentence-transformers' (prompt included), token counts too."""
    prompt_name = params.get("prompt_name")
    result = engine.embed(texts, EmbedParams(truncate=True, **params))
    expected = st.encode(texts, prompt_name=prompt_name, convert_to_numpy=True)
    assert result.embeddings.shape == (len(texts), 64)
    assert result.embeddings.dtype == np.float32
    assert_cosine_at_least(result.embeddings, expected, MIN_COSINE, texts, what=what)
    assert_unit_norm(result.embeddings)
    prompt = st.prompts.get(prompt_name or st.default_prompt_name or "", "")
    assert result.prompt_tokens == sum(reference_token_counts(st, texts, prompt=prompt))
    return result.embeddings


@pytest.mark.parametrize("pooling", DECODER_POOLINGS)
@pytest.mark.parametrize("arch", DECODER_ARCHS)
def test_tiny_decoder_matches_sentence_transformers(arch, pooling, tiny_decoder, reference, engine_for, texts):
    model_dir = tiny_decoder(arch, pooling, max_seq_length=MAX_SEQ_LENGTH)
    st = reference(model_dir)
    assert max(reference_token_counts(st, texts)) == MAX_SEQ_LENGTH, "the corpus must hold texts over the limit"

    engine = engine_for(model_dir)

    _check_parity(engine, st, texts, what=f"{arch}/{pooling}: ")
    assert engine.info.is_causal is True
    assert engine.info.pooling == pooling
    assert engine.info.dimension == 64
    assert engine.info.max_input_tokens == MAX_SEQ_LENGTH


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_naive_backend_matches_sentence_transformers(arch, tiny_decoder, reference, engine_for, texts):
    model_dir = tiny_decoder(arch, "mean", max_seq_length=MAX_SEQ_LENGTH)
    engine = engine_for(model_dir, attention_backend="naive")
    assert engine.info.attention_backend == "naive"
    _check_parity(engine, reference(model_dir), texts, what=f"{arch} naive: ")


@pytest.mark.parametrize(
    ("rope", "legacy"), [(LINEAR_ROPE, True), (LLAMA3_ROPE, False)], ids=["linear-legacy-config", "llama3"]
)
def test_rope_scaling_matches_sentence_transformers(rope, legacy, tiny_decoder, reference, engine_for, texts):
    """Scaled RoPE equals the reference and really changes the output of the same weights."""
    model_dir = tiny_decoder("llama", "lasttoken", rope_scaling=rope, legacy_rope_config=legacy)
    assert ("rope_scaling" in json.loads((model_dir / "config.json").read_text())) is legacy
    st = reference(model_dir)
    assert st[0].auto_model.config.rope_parameters["rope_type"] == rope["rope_type"]

    scaled = _check_parity(engine_for(model_dir), st, texts, what=f"{rope['rope_type']}: ")

    unscaled = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    plain_dir = tiny_decoder("llama", "lasttoken", rope_scaling=unscaled)
    plain = engine_for(plain_dir).embed(texts, EmbedParams(truncate=True)).embeddings
    changed = cosines(scaled, plain) < 0.999
    assert changed.mean() >= 0.8, f"rope scaling changed only {changed.sum()} of {len(texts)} embeddings"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_causal_lm_checkpoint_loads(tied, tiny_decoder, reference, engine_for, texts):
    """ForCausalLM weights (`model.` prefix; `lm_head.weight` when untied) load and match."""
    model_dir = tiny_decoder("llama", "lasttoken", tie_word_embeddings=tied, causal_lm_weights=True)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) is not tied
    assert "model.embed_tokens.weight" in names

    _check_parity(engine_for(model_dir), reference(model_dir), texts, what="tied: " if tied else "untied: ")


def test_instruction_prompts_match_sentence_transformers(tiny_decoder, reference, engine_for, texts):
    prompts = {"query": "Instruct: Given a question, retrieve passages that answer it\nQuery: ", "short": "Doc: "}
    model_dir = tiny_decoder("qwen3", "lasttoken", prompts=prompts, default_prompt_name="query")
    st = reference(model_dir)
    engine = engine_for(model_dir)
    assert st.default_prompt_name == "query"
    assert set(prompts) <= set(engine.info.prompt_names)

    default = _check_parity(engine, st, texts, what="default prompt: ")
    named = _check_parity(engine, st, texts, what="named prompt: ", prompt_name="short")

    assert np.all(cosines(default, named) < 0.99999), "the prompt had no effect"


def _transformers_bidirectional(model_dir, texts: list[str], pooling: str) -> np.ndarray:
    """transformers' own model over right-padded inputs with a full non-causal additive mask, pooled, normalized."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=MAX_SEQ_LENGTH, return_tensors="pt")
    assert tokenizer.padding_side == "right"
    keep = batch["attention_mask"].bool()
    # Every query sees every real key of its text: 0 where the key is real, the dtype's minimum for padding.
    mask = torch.zeros(keep.shape[0], 1, keep.shape[1], keep.shape[1])
    mask.masked_fill_(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    with torch.no_grad():
        hidden = model(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
    lengths = keep.sum(dim=1)
    if pooling == "lasttoken":
        pooled = hidden[torch.arange(len(texts)), lengths - 1]
    else:
        pooled = (hidden * keep[..., None]).sum(dim=1) / lengths[:, None]
    return normalized(pooled.numpy())


@pytest.mark.parametrize("pooling", DECODER_POOLINGS)
def test_bidirectional_decoder_matches_transformers(pooling, tiny_decoder, reference, engine_for, texts):
    """`is_causal: false` (gte-Qwen2 style): attention both ways, as transformers computes it with a full mask."""
    model_dir = tiny_decoder("qwen2", pooling, is_causal=False)
    engine = engine_for(model_dir)
    assert engine.info.is_causal is False
    assert engine.info.pooling == pooling

    bidirectional = engine.embed(texts, EmbedParams(truncate=True)).embeddings
    expected = _transformers_bidirectional(model_dir, texts, pooling)
    assert_cosine_at_least(bidirectional, expected, MIN_COSINE, texts, what=f"bidirectional/{pooling}: ")
    # transformers 5 builds the same mask itself from `is_causal: false`, so sentence-transformers agrees.
    _check_parity(engine, reference(model_dir), texts, what=f"bidirectional/{pooling} vs st: ")

    causal = engine_for(tiny_decoder("qwen2", pooling)).embed(texts, EmbedParams(truncate=True)).embeddings
    differs = cosines(bidirectional, causal) < 0.99
    assert differs.mean() >= 0.8, f"only {differs.sum()} of {len(texts)} embeddings differ from causal attention"


@pytest.mark.parametrize(
    ("arch", "window_options", "windows"),
    [
        ("mistral", {}, [16, 16]),
        # Qwen2 slides only with use_sliding_window, and then the layers from max_window_layers on.
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}, [None, 16]),
    ],
    ids=["mistral", "qwen2-layer-1"],
)
def test_sliding_window_matches_sentence_transformers_past_the_window(
    arch, window_options, windows, tiny_decoder, reference, engine_for, texts
):
    """A 16-token window on texts of up to 128 tokens: no input cap, and the windowed layers attend as
    transformers' sliding mask lets them (a query sees the 15 keys before it and itself)."""
    model_dir = tiny_decoder(arch, "mean", max_seq_length=MAX_SEQ_LENGTH, sliding_window=16, **window_options)
    hf_config = read_hf_config(model_dir)
    with torch.device("meta"):
        assert [layer.sliding_window for layer in attention_layers(LlamaModel(hf_config))] == windows
    st = reference(model_dir)
    assert sum(n > 32 for n in reference_token_counts(st, texts)) >= len(texts) // 2, "texts must pass the window"
    engine = engine_for(model_dir)
    assert engine.info.max_input_tokens == MAX_SEQ_LENGTH

    windowed = _check_parity(engine, st, texts, what=f"{arch} sliding window: ")

    # The same weights without a window give other embeddings for the long texts: the window was applied.
    plain_dir = tiny_decoder(arch, "mean", max_seq_length=MAX_SEQ_LENGTH, sliding_window=None)
    plain = engine_for(plain_dir).embed(texts, EmbedParams(truncate=True)).embeddings
    long_texts = np.array(reference_token_counts(st, texts)) > 32
    assert np.all(cosines(windowed, plain)[long_texts] < 0.99999), "the window changed no long text's embedding"


def test_batch_invariance(tiny_decoder, engine_for):
    """One input alone equals the same input packed with 50 others (positions restart per sequence)."""
    engine = engine_for(tiny_decoder("qwen3", "lasttoken", max_seq_length=MAX_SEQ_LENGTH))
    pool = stdlib_texts(60, seed=7)
    target, others = pool[0], pool[1:51]
    params = EmbedParams(truncate=True)

    alone = engine.embed([target], params).embeddings[0]
    packed = engine.embed([*others[:25], target, *others[25:]], params).embeddings[25]

    diff = float(np.max(np.abs(packed - alone)))
    assert diff <= 1e-5, f"input packed with 50 others differs from alone by {diff}"


def test_bfloat16_is_close_to_float32(tiny_decoder, reference, engine_for, texts):
    model_dir = tiny_decoder("qwen3", "mean", max_seq_length=MAX_SEQ_LENGTH)
    expected = reference(model_dir).encode(texts, convert_to_numpy=True)

    result = engine_for(model_dir, dtype="bfloat16").embed(texts, EmbedParams(truncate=True))

    assert result.embeddings.dtype == np.float32
    assert_cosine_at_least(result.embeddings, expected, 0.99, texts, what="bfloat16: ")


def test_attention_override_wins_over_the_config(tiny_decoder, engine_for, texts):
    """--attention bidirectional on a causal config equals the same weights with `is_causal: false`, and back."""
    params = EmbedParams(truncate=True)
    causal_dir = tiny_decoder("qwen2", "mean")
    bidirectional_dir = tiny_decoder("qwen2", "mean", is_causal=False)

    forced_bidirectional = engine_for(causal_dir, attention="bidirectional")
    forced_causal = engine_for(bidirectional_dir, attention="causal")

    assert forced_bidirectional.info.is_causal is False
    assert forced_causal.info.is_causal is True
    np.testing.assert_allclose(
        forced_bidirectional.embed(texts, params).embeddings,
        engine_for(bidirectional_dir).embed(texts, params).embeddings,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        forced_causal.embed(texts, params).embeddings, engine_for(causal_dir).embed(texts, params).embeddings, atol=1e-6
    )


@pytest.mark.slow  # compiles flex on CPU; the attention tests cover flex against naive on causal GQA
def test_flex_backend_on_a_causal_gqa_decoder(tiny_decoder, reference, engine_for, texts):
    """Compiled FlexAttention with the causal document mask and grouped KV heads, through the whole model."""
    model_dir = tiny_decoder("qwen3", "lasttoken", max_seq_length=MAX_SEQ_LENGTH)
    # A small batch budget keeps the warm-up to two compiled size classes.
    engine = engine_for(model_dir, attention_backend="flex", max_batch_tokens=256)
    assert engine.info.attention_backend == "flex"
    _check_parity(engine, reference(model_dir), texts, what="flex: ")
