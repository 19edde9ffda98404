"""Late chunking (engine/tasks/late_chunking.py) against the formula computed here with transformers on the same
random weights, float32: the whole input's last_hidden_state, each chunk the mean of the states of the tokens
whose characters overlap its span, then dimensions and normalization. CLS- and mean-pooled models get the same
formula (late chunking's pooling is always the mean).

An input longer than the model's context runs as windows; the reference rebuilds them from the documented rule
(windows of the largest size that fits, neighbours sharing room // 4 tokens, the last one ending at the text's
end; each shared token's state from the earlier window in the first half of the overlap, else the later).
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.corpus import stdlib_texts
from tests.helpers.compare import assert_cosine_at_least, normalized

LONG_LIMIT = 32
COSINE = 0.9999


def _params(**late):
    from embedserv.types import ChunkSplitter, EmbedParams, LateChunking

    options = {key: late.pop(key) for key in ("normalize", "dimensions", "prompt_name", "encoding") if key in late}
    splitter = ChunkSplitter(late.pop("splitter", "spans"))
    return EmbedParams(late_chunking=LateChunking(splitter=splitter, **late), **options)


@pytest.fixture(scope="module")
def hf_tokenizer(bundled_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bundled_dir))


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def short_text(hf_tokenizer) -> str:
    return next(t for t in stdlib_texts(300, seed=5) if 25 <= _count(hf_tokenizer, t) <= 60)


@pytest.fixture(scope="module")
def long_text(hf_tokenizer) -> str:
    """Four to six windows of the 32-token model."""
    return next(t for t in stdlib_texts(300, seed=5) if 100 <= _count(hf_tokenizer, t) <= 140)


def _text_states(tokenizer, model, text: str, prompt: str, limit: int, first_window_wins: bool = False):
    """(states [t, hidden], offsets [t, 2]) of the text's tokens, by the documented window rule."""
    import torch

    encoding = tokenizer(prompt + text, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    content, content_offsets = ids[1:-1], offsets[1:-1]
    num_prompt = sum(1 for start, _ in content_offsets if start < len(prompt)) if prompt else 0
    text_ids = content[num_prompt:]
    text_offsets = np.maximum(np.array(content_offsets[num_prompt:]).reshape(-1, 2) - len(prompt), 0)
    head, tail = [ids[0], *content[:num_prompt]], [ids[-1]]

    def run(window):
        with torch.no_grad():
            return model(input_ids=torch.tensor([head + window + tail])).last_hidden_state[0, len(head) : -1].numpy()

    count = len(text_ids)
    if len(ids) <= limit:
        return run(text_ids), text_offsets
    room = limit - len(head) - len(tail)
    stride = room - room // 4
    firsts = [*range(0, count - room, stride), count - room]
    parts = []
    for k, first in enumerate(firsts):
        states = run(text_ids[first : first + room])
        if first_window_wins:
            low = 0 if k == 0 else firsts[k - 1] + room
        else:
            low = 0 if k == 0 else (first + firsts[k - 1] + room) // 2
        high = count if k == len(firsts) - 1 else (firsts[k + 1] + first + room) // 2
        if first_window_wins and k < len(firsts) - 1:
            high = first + room
        parts.append(states[low - first : high - first])
    return np.concatenate(parts), text_offsets


def reference_chunks(model_dir, text: str, spans, limit: int, prompt: str = "", **rule) -> np.ndarray:
    """[chunks, hidden] float32, not normalized: each span's mean token state."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    states, offsets = _text_states(tokenizer, model, text, prompt, limit, **rule)
    rows = []
    for start, end in spans:
        members = [j for j, (s, e) in enumerate(offsets) if min(e, end) - max(s, start) > 0]
        assert members, (start, end)
        rows.append(states[members].mean(axis=0))
    return np.stack(rows)


def _edge_spans(text: str) -> list[tuple[int, int]]:
    """The first and last characters, a span cut mid-word, half the text, and all of it."""
    n = len(text)
    return [(0, 1), (n - 1, n), (3, 17), (n // 2, n), (0, n), (0, 9)]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_chunks_are_the_mean_of_their_tokens_whole_input_states(
    pooling, tiny_encoder, engine_for, hf_tokenizer, short_text
):
    model_dir = tiny_encoder("bert", pooling, max_seq_length=128)
    engine = engine_for(model_dir)
    spans = _edge_spans(short_text)
    expected = reference_chunks(model_dir, short_text, spans, 128)

    result = engine.embed([short_text], _params(spans=(tuple(spans),)))
    raw = engine.embed([short_text], _params(spans=(tuple(spans),), normalize=False)).chunks[0][1]
    cut = engine.embed([short_text], _params(spans=(tuple(spans),), dimensions=16)).chunks[0][1]

    assert result.embeddings is None
    [(got_spans, vectors)] = result.chunks
    assert got_spans == tuple(spans) and vectors.shape == (len(spans), 64)
    assert_cosine_at_least(vectors, expected, COSINE, what="late chunks: ")
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(raw, expected, atol=1e-5)
    np.testing.assert_allclose(cut, normalized(expected[:, :16]), atol=1e-5)
    # One forward pass over the input with its special tokens.
    assert result.prompt_tokens == _count(hf_tokenizer, short_text) + 2
    # Not the model's own pooling of the whole text: (0, n) pools the text's tokens only, by the mean.
    whole = engine.embed([short_text], _params_plain()).embeddings[0]
    assert not np.allclose(vectors[4], whole, atol=1e-3)


def _params_plain():
    from embedserv.types import EmbedParams

    return EmbedParams()


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_document_longer_than_the_context_runs_as_overlapping_windows(
    pooling, tiny_encoder, engine_for, hf_tokenizer, long_text
):
    model_dir = tiny_encoder("bert", pooling, max_seq_length=LONG_LIMIT)
    engine = engine_for(model_dir)
    n = len(long_text)
    spans = [*_edge_spans(long_text), *[(start, start + 40) for start in range(0, n - 40, 37)]]
    expected = reference_chunks(model_dir, long_text, spans, LONG_LIMIT)
    other_rule = reference_chunks(model_dir, long_text, spans, LONG_LIMIT, first_window_wins=True)

    result = engine.embed([long_text], _params(spans=(tuple(spans),), normalize=False))
    vectors = result.chunks[0][1]

    assert_cosine_at_least(vectors, expected, COSINE, what="long-document late chunks: ")
    np.testing.assert_allclose(vectors, expected, atol=1e-5)
    # The window rule is visible: taking every shared token from the earlier window gives other vectors.
    assert not np.allclose(vectors, other_rule, atol=1e-4)
    # Usage counts every window's tokens: each window is full (32), so more than the text's own tokens.
    tokens = _count(hf_tokenizer, long_text)
    assert result.prompt_tokens % LONG_LIMIT == 0 and result.prompt_tokens > tokens + 2


def test_the_prompt_runs_with_the_text_and_in_every_window(tiny_encoder, engine_for, short_text, long_text):
    prompt = "search query: "
    model_dir = tiny_encoder("bert", "mean", max_seq_length=LONG_LIMIT, prompts={"query": prompt})
    engine = engine_for(model_dir)
    for text in (short_text[:60], long_text):
        spans = _edge_spans(text)
        expected = reference_chunks(model_dir, text, spans, LONG_LIMIT, prompt=prompt)
        got = engine.embed([text], _params(spans=(tuple(spans),), prompt_name="query")).chunks[0][1]
        assert_cosine_at_least(got, expected, COSINE, what=f"prompted ({len(text)} chars): ")
        plain = engine.embed([text], _params(spans=(tuple(spans),))).chunks[0][1]
        assert not np.allclose(got, plain, atol=1e-4)


def test_inputs_batch_as_if_alone(tiny_encoder, engine_for, short_text, long_text):
    engine = engine_for(tiny_encoder("bert", "mean", max_seq_length=LONG_LIMIT))
    texts = [short_text, long_text, short_text[:40].rstrip()]
    spans = tuple(tuple(_edge_spans(t)) for t in texts)
    together = engine.embed(texts, _params(spans=spans)).chunks
    for index, text in enumerate(texts):
        [(alone_spans, alone)] = engine.embed([text], _params(spans=(spans[index],))).chunks
        assert together[index][0] == alone_spans
        np.testing.assert_allclose(together[index][1], alone, atol=1e-6)


SENTENCE_TEXT = "First one. Second one!  Third? e.g. this\nA new line\n\n  last words."
SENTENCE_SPANS = ((0, 10), (11, 22), (24, 30), (31, 35), (36, 40), (41, 51), (55, 66))


def test_sentences_split_after_closing_punctuation_and_at_newlines(tiny_encoder, engine_for):
    engine = engine_for(tiny_encoder("bert", "mean", max_seq_length=128))
    [(spans, vectors)] = engine.embed([SENTENCE_TEXT], _params(splitter="sentences")).chunks
    assert spans == SENTENCE_SPANS, [SENTENCE_TEXT[s:e] for s, e in spans]
    assert [SENTENCE_TEXT[s:e] for s, e in spans][-2:] == ["A new line", "last words."]
    [(_, by_spans)] = engine.embed([SENTENCE_TEXT], _params(spans=(SENTENCE_SPANS,))).chunks
    np.testing.assert_array_equal(vectors, by_spans)


def test_token_windows_report_their_character_spans(tiny_encoder, engine_for, hf_tokenizer, long_text):
    engine = engine_for(tiny_encoder("bert", "mean", max_seq_length=LONG_LIMIT))
    offsets = hf_tokenizer(long_text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    size, overlap = 7, 2
    expected = []
    for first in range(0, len(offsets), size - overlap):
        stop = min(first + size, len(offsets))
        expected.append((offsets[first][0], offsets[stop - 1][1]))
        if stop == len(offsets):
            break
    [(spans, vectors)] = engine.embed(
        [long_text], _params(splitter="tokens", chunk_tokens=size, overlap_tokens=overlap)
    ).chunks
    assert spans == tuple(expected)
    [(_, by_spans)] = engine.embed([long_text], _params(spans=(spans,))).chunks
    np.testing.assert_array_equal(vectors, by_spans)


def test_chunks_take_the_calls_encoding(tiny_encoder, engine_for, short_text):
    from embedserv.types import Encoding

    engine = engine_for(tiny_encoder("bert", "mean", max_seq_length=128))
    spans = (tuple(_edge_spans(short_text)),)
    floats = engine.embed([short_text], _params(spans=spans)).chunks[0][1]
    halves = engine.embed([short_text], _params(spans=spans, encoding=Encoding.FLOAT16)).chunks[0][1]
    codes = engine.embed([short_text], _params(spans=spans, encoding=Encoding.UBINARY)).chunks[0][1]
    assert halves.dtype == np.float16 and codes.dtype == np.uint8
    np.testing.assert_array_equal(halves, floats.astype(np.float16))
    np.testing.assert_array_equal(codes, np.packbits(floats > 0, axis=-1))
    # int8: the codes the call's encoding gives these float vectors as a plain Embed's (the model's calibration).
    from embedserv.types import EmbedResult

    params = _params(spans=spans, encoding=Encoding.INT8)
    int8 = engine.embed([short_text], params).chunks[0][1]
    floats_result = EmbedResult(embeddings=floats.copy(), prompt_tokens=0)
    as_embed = engine._call(engine.engine.embedding.in_encoding(floats_result, params))
    assert int8.dtype == np.int8
    np.testing.assert_array_equal(int8, as_embed.embeddings)


def test_a_model_whose_token_vectors_are_a_head_is_refused(engine_for, tmp_path_factory, short_text):
    """bge-m3's token vectors come from its colbert head, not its hidden states: nothing to pool from."""
    from embedserv.errors import InvalidInput
    from tests.helpers.sparse_models import build_bge_m3

    engine = engine_for(build_bge_m3(tmp_path_factory.mktemp("bge-m3"), head_format="safetensors"))
    with pytest.raises(InvalidInput, match="its token vectors are not its final hidden states"):
        engine.embed([short_text], _params(spans=(((0, 5),),)))


def test_a_long_context_family_with_local_attention(tmp_path_factory, engine_for, long_text):
    """ModernBERT (global and 16-token local layers), mean-pooled, past its context: windows, then chunks."""
    from tests.helpers.modernbert_models import build_modernbert_embedder

    model_dir = build_modernbert_embedder(tmp_path_factory.mktemp("modernbert"), "mean", max_seq_length=LONG_LIMIT)
    engine = engine_for(model_dir)
    spans = _edge_spans(long_text)
    expected = reference_chunks(model_dir, long_text, spans, LONG_LIMIT)
    got = engine.embed([long_text], _params(spans=(tuple(spans),), normalize=False)).chunks[0][1]
    assert_cosine_at_least(got, expected, COSINE, what="ModernBERT late chunks: ")


@pytest.mark.parametrize("activation", ["tanh", "identity"])
def test_dense_modules_apply_to_each_chunks_mean(activation, tmp_path_factory, engine_for, short_text, long_text):
    """An embedder with a Dense module (as distiluse-base-multilingual-cased): each chunk's mean state goes
    through sentence-transformers' own Dense, then normalization."""
    import torch

    from tests.helpers.classic_models import build_classic_encoder
    from tests.helpers.models import load_reference

    root = tmp_path_factory.mktemp(f"dense-{activation}")
    model_dir = build_classic_encoder(root, "mpnet", "mean", max_seq_length=LONG_LIMIT, dense=(24, activation))
    dense = load_reference(model_dir)[2]
    engine = engine_for(model_dir)
    for text in (short_text, long_text):
        spans = _edge_spans(text)
        means = torch.from_numpy(reference_chunks(model_dir, text, spans, LONG_LIMIT))
        with torch.no_grad():
            expected = dense({"sentence_embedding": means})["sentence_embedding"].numpy()
        got = engine.embed([text], _params(spans=(tuple(spans),))).chunks[0][1]
        assert got.shape == (len(spans), 24)
        assert_cosine_at_least(got, expected, COSINE, what=f"Dense late chunks ({len(text)} chars): ")
