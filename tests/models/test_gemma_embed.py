"""Gemma embedders through engine.embed equal sentence-transformers (cosine >= 0.9999) on texts far longer
than their sliding windows.

- EmbeddingGemma's shape (tests/helpers/gemma_models.py): a bidirectional Gemma3TextModel whose config
  window of 16 becomes 9 on load (|p - j| < 9 both ways), mean pooling, two Dense layers, its prompts.
- A Gemma 4 last-token embedder with shared-KV layers, causal (window 10), with and without
  --kv-sharing-fast-prefill (the shared layers then run each text's last token only); and the same weights
  with `use_bidirectional_attention: "all"` (|p - j| <= 6 after the config halves 10).
"""

from __future__ import annotations

import pytest
import torch

from embedserv.attention.layer import attention_layers
from embedserv.models import registry
from embedserv.models.loading.hf_config import read_hf_config
from tests.helpers import gemma_models
from tests.helpers.models import reference_token_counts
from tests.models.test_decoder_parity import _check_parity


@pytest.fixture(scope="module")
def gemma_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gemma-embedders")


@pytest.fixture(scope="module")
def embeddinggemma(gemma_root):
    return gemma_models.build_embeddinggemma(gemma_root)


@pytest.fixture(scope="module")
def gemma4_embedder(gemma_root):
    return gemma_models.build_gemma4_embedder(gemma_root)


def _windows(model_dir) -> set[int | None]:
    hf_config = read_hf_config(model_dir)
    with torch.device("meta"):
        model = registry.lookup(hf_config.model_type).model_class(hf_config)
    return {layer.sliding_window for layer in attention_layers(model)}


def _assert_texts_pass_the_window(st, texts, window: int) -> None:
    counts = reference_token_counts(st, texts)
    assert sum(n > 2 * window for n in counts) >= len(texts) // 2, f"texts too short for a window of {window}"


def test_embeddinggemma_matches_sentence_transformers(embeddinggemma, reference, engine_for, texts):
    assert read_hf_config(embeddinggemma).sliding_window == 9
    assert _windows(embeddinggemma) == {None, 9}
    st = reference(embeddinggemma)
    _assert_texts_pass_the_window(st, texts, 9)
    engine = engine_for(embeddinggemma)
    assert engine.info.is_causal is False
    assert engine.info.pooling == "mean"
    assert engine.info.dimension == 64
    assert set(gemma_models.EMBEDDINGGEMMA_PROMPTS) <= set(engine.info.prompt_names)

    _check_parity(engine, st, texts, what="embeddinggemma: ")
    for prompt_name in ("query", "document"):
        _check_parity(engine, st, texts, what=f"embeddinggemma {prompt_name}: ", prompt_name=prompt_name)


@pytest.mark.parametrize("fast_prefill", [False, True], ids=["all-rows", "fast-prefill"])
def test_gemma4_last_token_embedder_matches_sentence_transformers(
    fast_prefill, gemma4_embedder, reference, engine_for, texts
):
    assert _windows(gemma4_embedder) == {None, gemma_models.GEMMA4_WINDOW}
    st = reference(gemma4_embedder)
    _assert_texts_pass_the_window(st, texts, gemma_models.GEMMA4_WINDOW)
    engine = engine_for(gemma4_embedder, kv_sharing_fast_prefill=fast_prefill)
    assert engine.info.is_causal is True
    assert engine.info.pooling == "lasttoken"
    _check_parity(engine, st, texts, what=f"gemma4 lasttoken (fast prefill {fast_prefill}): ")


def test_bidirectional_gemma4_matches_sentence_transformers(gemma4_embedder, reference, engine_for, texts, tmp_path):
    """`use_bidirectional_attention: "all"`: the config halves the window to 6 and transformers' mask keeps
    |q - kv| <= 6, so our layers attend within W = 7."""
    model_dir = gemma_models.with_config(gemma4_embedder, tmp_path / "all", use_bidirectional_attention="all")
    assert read_hf_config(model_dir).sliding_window == gemma_models.GEMMA4_WINDOW // 2 + 1
    assert _windows(model_dir) == {None, gemma_models.GEMMA4_WINDOW // 2 + 2}
    engine = engine_for(model_dir)
    assert engine.info.is_causal is False
    _check_parity(engine, reference(model_dir), texts, what="gemma4 bidirectional: ")
