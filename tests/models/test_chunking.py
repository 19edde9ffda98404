"""Long inputs by windows (engine/tasks/chunking.py), against references computed here with transformers and
sentence-transformers on the same random weights, float32.

The tiny models take 32 tokens, so a text of about 80 word-pieces is three windows. The reference splits
the text's tokens (no special tokens) into windows of 32 - 2 (- prompt) tokens, wraps each in [CLS] ... [SEP],
runs transformers' model, pools as the model pools, and averages the windows weighted by their lengths.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from benchmarks.corpus import stdlib_texts
from tests.helpers.scorers import build_cross_encoder

LIMIT = 32
ATOL = 1e-5


def _embed_params(**kwargs):
    from embedserv.types import EmbedParams

    return EmbedParams(chunking=True, **kwargs)


def _rerank_params(**kwargs):
    from embedserv.types import RerankParams

    return RerankParams(chunking=True, **kwargs)


@pytest.fixture(scope="module")
def hf_tokenizer(bundled_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bundled_dir))


def _content_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def long_text(hf_tokenizer) -> str:
    """A real text of 61 to 90 word-pieces: three windows of 30."""
    return next(t for t in stdlib_texts(300, seed=3) if 61 <= len(_content_ids(hf_tokenizer, t)) <= 90)


@pytest.fixture(scope="module")
def short_text(hf_tokenizer) -> str:
    return next(t for t in stdlib_texts(300, seed=3) if 8 <= len(_content_ids(hf_tokenizer, t)) <= 20)


def _windows(ids: list[int], size: int) -> list[list[int]]:
    return [ids[start : start + size] for start in range(0, len(ids), size)]


def reference_windows(model_dir, text: str, pooling: str, prompt: str = "", include_prompt: bool = True):
    """(pooled vector per window [n, dim], window lengths) computed with transformers."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    prompt_ids = _content_ids(tokenizer, prompt) if prompt else []
    vectors, lengths = [], []
    for window in _windows(_content_ids(tokenizer, text), LIMIT - 2 - len(prompt_ids)):
        ids = [tokenizer.cls_token_id, *prompt_ids, *window, tokenizer.sep_token_id]
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        skip = 0 if include_prompt else 1 + len(prompt_ids)
        vectors.append((hidden[0] if pooling == "cls" else hidden[skip:].mean(dim=0)).numpy())
        lengths.append(len(ids))
    return np.stack(vectors), lengths


def _unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector, axis=-1, keepdims=True)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_chunked_embedding_is_the_weighted_mean_of_its_windows(pooling, tiny_encoder, engine_for, long_text):
    model_dir = tiny_encoder("bert", pooling, max_seq_length=LIMIT)
    engine = engine_for(model_dir)
    vectors, lengths = reference_windows(model_dir, long_text, pooling)
    assert len(lengths) == 3 and lengths[:2] == [LIMIT, LIMIT]
    mean = np.average(vectors, axis=0, weights=lengths)

    result = engine.embed([long_text], _embed_params())
    raw = engine.embed([long_text], _embed_params(normalize=False)).embeddings[0]
    cut = engine.embed([long_text], _embed_params(dimensions=16)).embeddings[0]

    np.testing.assert_allclose(result.embeddings[0], _unit(mean), atol=ATOL)
    np.testing.assert_allclose(raw, mean, atol=ATOL)
    np.testing.assert_allclose(cut, _unit(mean[:16]), atol=ATOL)
    assert result.prompt_tokens == sum(lengths)
    # Not the plain mean, nor the first window: the weights matter.
    assert not np.allclose(result.embeddings[0], _unit(vectors.mean(axis=0)), atol=1e-4)


def test_a_text_that_fits_is_embedded_exactly_as_without_chunking(tiny_encoder, engine_for, short_text):
    from embedserv.types import EmbedParams

    engine = engine_for(tiny_encoder("bert", "mean", max_seq_length=LIMIT))
    chunked = engine.embed([short_text], _embed_params())
    plain = engine.embed([short_text], EmbedParams())

    np.testing.assert_array_equal(chunked.embeddings, plain.embeddings)
    assert chunked.prompt_tokens == plain.prompt_tokens


def test_windows_of_many_inputs_batch_as_if_alone(tiny_encoder, engine_for, long_text, short_text):
    engine = engine_for(tiny_encoder("bert", "mean", max_seq_length=LIMIT))
    inputs = [short_text, long_text, long_text[: len(long_text) // 2], short_text]
    together = engine.embed(inputs, _embed_params())
    alone = np.concatenate([engine.embed([text], _embed_params()).embeddings for text in inputs])

    np.testing.assert_allclose(together.embeddings, alone, atol=1e-6)
    np.testing.assert_array_equal(together.embeddings[0], together.embeddings[3])


def test_each_window_carries_the_prompt_and_pooling_skips_it(tiny_encoder, engine_for, long_text, tmp_path):
    """A model whose Pooling excludes the prompt (include_prompt false): every window is [CLS] prompt ... [SEP]
    and the mean starts after the prompt, as sentence-transformers pools one prompted input."""
    built = tiny_encoder("bert", "mean", max_seq_length=LIMIT, prompts={"query": "search query: "})
    model_dir = tmp_path / "no-prompt-pooling"
    shutil.copytree(built, model_dir)
    pooling_config = model_dir / "1_Pooling" / "config.json"
    pooling_config.write_text(json.dumps({**json.loads(pooling_config.read_text()), "include_prompt": False}))
    engine = engine_for(model_dir)
    vectors, lengths = reference_windows(model_dir, long_text, "mean", prompt="search query: ", include_prompt=False)
    assert len(lengths) >= 3

    result = engine.embed([long_text], _embed_params(prompt_name="query"))

    np.testing.assert_allclose(result.embeddings[0], _unit(np.average(vectors, axis=0, weights=lengths)), atol=ATOL)
    assert result.prompt_tokens == sum(lengths)


def test_embed_chunking_refusals(tiny_encoder, engine_for, long_text):
    from embedserv.engine import checks
    from embedserv.errors import InvalidInput
    from embedserv.types import EmbedOutput, ModelInfo

    engine = engine_for(tiny_encoder("bert", "mean", max_seq_length=LIMIT))
    with pytest.raises(InvalidInput, match=r"chunking gives the dense output only.*outputs: dense, multi_vector"):
        engine.embed([long_text], _embed_params(outputs=(EmbedOutput.DENSE, EmbedOutput.MULTI_VECTOR)))
    sparse_only = ModelInfo(
        name="splade",
        tasks=(),
        architecture="BertForMaskedLM",
        is_causal=False,
        pooling="splade",
        dimension=0,
        max_input_tokens=LIMIT,
        prompt_names=(),
        dtype="float32",
        device="cpu",
        attention_backend="sdpa",
        outputs=(EmbedOutput.SPARSE,),
    )
    with pytest.raises(InvalidInput, match=r"cannot embed by windows .*its outputs: sparse"):
        checks.check_embed_chunking(sparse_only, _embed_params(outputs=(EmbedOutput.SPARSE,)))


def test_a_prompt_that_fills_the_limit_is_refused(bundled_dir):
    from embedserv.engine.inputs.tokenizer import TextTokenizer
    from embedserv.errors import InvalidInput

    tokenizer = TextTokenizer(bundled_dir, 8, prompts={"long": "one two three four five six "})
    with pytest.raises(InvalidInput, match="the prompt takes 6 tokens, which leaves no room"):
        tokenizer.encode_windows(["hello"], "long")
    assert [len(w.ids) for w in tokenizer.encode_windows(["a b c d e f g h i j k l m n"])[0]] == [8, 8, 4]


# Rerank: cross-encoders score each (query, window) pair; embedders compare the query with each window.


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("chunking-ce"), "bert", max_seq_length=LIMIT)


def _one_token_words(tokenizer, count: int) -> list[str]:
    """Real words that are one word-piece each, so a window of tokens is a window of words."""
    words = [w for t in stdlib_texts(200, seed=5) for w in t.lower().split() if w.isalpha()]
    return [w for w in words if len(_content_ids(tokenizer, w)) == 1][:count]


def _scores(result, count: int) -> np.ndarray:
    scores = np.full(count, np.nan, dtype=np.float32)
    for ranked in result.results:
        scores[ranked.index] = ranked.score
    return scores


@pytest.mark.parametrize("raw_scores", [False, True])
def test_cross_encoder_scores_a_document_by_its_best_window(raw_scores, cross_encoder_dir, engine_for, hf_tokenizer):
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(cross_encoder_dir), device="cpu")
    engine = engine_for(cross_encoder_dir)
    words = _one_token_words(hf_tokenizer, 200)
    query = "how to parse a file"
    room = LIMIT - 3 - len(_content_ids(hf_tokenizer, query))
    documents = [" ".join(words[:70]), " ".join(words[70:80]), " ".join(words[80:200]), " ".join(words[:room])]
    activation = (lambda x: x) if raw_scores else None
    expected, firsts, tokens = [], [], 0
    for document in documents:
        windows = [" ".join(w) for w in _windows(document.split(), room)]
        window_scores = reference.predict([(query, w) for w in windows], activation_fn=activation)
        expected.append(window_scores.max())
        firsts.append(window_scores[0])
        tokens += sum(len(reference.tokenizer(query, w)["input_ids"]) for w in windows)

    result = engine.rerank(query, documents, _rerank_params(raw_scores=raw_scores))
    top = engine.rerank(query, documents, _rerank_params(raw_scores=raw_scores, top_n=2))

    np.testing.assert_allclose(_scores(result, 4), expected, atol=1e-4)
    assert [r.index for r in result.results] == list(np.argsort(-np.array(expected), kind="stable"))
    assert [r.index for r in top.results] == [r.index for r in result.results[:2]]
    assert result.prompt_tokens == tokens
    assert np.any(np.array(expected) > np.array(firsts) + 1e-3), "some document's best window must not be its first"


def test_cross_encoder_documents_that_fit_score_as_without_chunking(cross_encoder_dir, engine_for, short_text):
    from embedserv.types import RerankParams

    engine = engine_for(cross_encoder_dir)
    documents = [short_text, short_text[:20], "x"]
    chunked = engine.rerank("the query", documents, _rerank_params())
    plain = engine.rerank("the query", documents, RerankParams())

    assert chunked.results == plain.results
    assert chunked.prompt_tokens == plain.prompt_tokens


def test_embedder_scores_a_document_by_its_best_window(tiny_encoder, reference, engine_for, long_text, short_text):
    model_dir = tiny_encoder("bert", "cls", max_seq_length=LIMIT)
    query = "iterate over the items"
    query_vector = _unit(reference(model_dir).encode([query], convert_to_numpy=True)[0])
    expected = []
    for document in (long_text, short_text):
        vectors, _ = reference_windows(model_dir, document, "cls")
        expected.append(float((_unit(vectors) @ query_vector).max()))

    result = engine_for(model_dir).rerank(query, [long_text, short_text], _rerank_params())

    np.testing.assert_allclose(_scores(result, 2), expected, atol=1e-5)


def test_rerank_chunking_refusals(cross_encoder_dir, engine_for, long_text):
    from embedserv.engine import checks
    from embedserv.errors import InvalidInput
    from embedserv.types import RerankMode

    engine = engine_for(cross_encoder_dir)
    with pytest.raises(InvalidInput, match="the query has .* tokens, which leaves no room for a document"):
        engine.rerank(long_text, ["short"], _rerank_params())
    for mode, what in ((RerankMode.TEMPLATE, "a yes/no reranker"), (RerankMode.MAXSIM, "MaxSim")):
        with pytest.raises(InvalidInput, match=f"{what}.*works with cross-encoders and embedding models.*truncate"):
            checks.check_rerank_chunking(engine.info, mode)
