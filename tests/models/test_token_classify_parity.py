"""ClassifyTokens equals transformers on the same random weights (float32): every family's per-token
probabilities equal the softmax of its *ForTokenClassification logits, with the tokenizer's character offsets and
no special tokens, alone or in a batch of mixed lengths; and the entities equal pipeline("token-classification")
for each aggregation strategy and for ignore_labels."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.token_classifier_models import (
    NER_LABELS,
    NER_TEXTS,
    TOKEN_CLASSIFIER_ARCHS,
    build_token_classifier,
    pipeline_entities,
    token_logits_reference,
)

ATOL = 1e-4
STRATEGIES = ("none", "simple", "first", "average", "max")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("token-classifiers")
    cache: dict[tuple[str, str], object] = {}

    def get(arch: str, tokenizer: str = "wordpiece"):
        if (arch, tokenizer) not in cache:
            cache[arch, tokenizer] = build_token_classifier(root, arch, tokenizer=tokenizer)
        return cache[arch, tokenizer]

    return get


def _params(**kwargs):
    from embedserv.engine.tasks.token_classification import TokenClassifyParams

    return TokenClassifyParams(**kwargs)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("arch", TOKEN_CLASSIFIER_ARCHS)
def test_token_probabilities_equal_transformers_alone_and_batched(arch, models, engine_for):
    from transformers import AutoTokenizer

    model_dir = models(arch)
    engine = engine_for(model_dir)
    assert [t.value for t in engine.info.tasks] == ["token_classify"]
    assert engine.info.labels == NER_LABELS

    batched = engine.classify_tokens(NER_TEXTS)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    best_labels = set()
    for index, (text, logits) in enumerate(zip(NER_TEXTS, token_logits_reference(model_dir, NER_TEXTS), strict=True)):
        encoded = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        kept = [i for i, special in enumerate(encoded["special_tokens_mask"]) if not special]
        tokens = batched.tokens[index]
        assert [t.index for t in tokens] == kept, "every non-special token, in order"
        assert [(t.start, t.end) for t in tokens] == [tuple(encoded["offset_mapping"][i]) for i in kept]
        got = np.stack([t.scores for t in tokens])
        np.testing.assert_allclose(got, _softmax(logits)[kept], atol=ATOL, err_msg=f"{arch}: text {index}")
        alone = engine.classify_tokens([text])
        np.testing.assert_allclose(np.stack([t.scores for t in alone.tokens[0]]), got, atol=1e-5)
        best_labels.update(t.best for t in tokens)
    assert len(best_labels) > 2, "tokens must not all get the same label"
    assert batched.prompt_tokens == sum(len(tokenizer(text)["input_ids"]) for text in NER_TEXTS)


def _as_pipeline(entities, strategy: str) -> list[dict]:
    key = "entity" if strategy == "none" else "entity_group"
    out = []
    for entity in entities:
        item = {key: entity.label, "score": entity.score, "word": entity.word, "start": entity.start, "end": entity.end}
        if strategy == "none":
            item["index"] = entity.index
        out.append(item)
    return out


def _assert_same_entities(got: list[dict], expected: list[dict], what: str) -> None:
    assert [{k: v for k, v in e.items() if k != "score"} for e in got] == [
        {k: (int(v) if k in ("start", "end", "index") else v) for k, v in e.items() if k != "score"} for e in expected
    ], what
    np.testing.assert_allclose(
        [e["score"] for e in got], [float(e["score"]) for e in expected], atol=ATOL, err_msg=what
    )


# WordPiece marks word pieces (`##`); the BPE tokenizer does not, and the pipeline then guesses words by spaces.
@pytest.mark.parametrize(("arch", "tokenizer"), [("bert", "wordpiece"), ("deberta-v2", "wordpiece"), ("bert", "bpe")])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_entities_equal_the_token_classification_pipeline(arch, tokenizer, strategy, models, engine_for):
    from embedserv.engine.tasks.entities import Aggregation

    model_dir = models(arch, tokenizer)
    result = engine_for(model_dir).classify_tokens(NER_TEXTS, _params(aggregation=Aggregation(strategy)))
    expected = pipeline_entities(model_dir, NER_TEXTS, strategy)
    assert sum(map(len, expected)) > 3, "the pipeline must find entities for the comparison to mean something"
    for index, (entities, reference) in enumerate(zip(result.entities, expected, strict=True)):
        what = f"{arch}/{tokenizer}/{strategy}: text {index}"
        _assert_same_entities(_as_pipeline(entities, strategy), reference, what)


def test_word_strategies_differ_on_these_texts(models, engine_for):
    """The texts make FIRST, AVERAGE and MAX disagree somewhere, so the comparisons above tell them apart."""
    from embedserv.engine.tasks.entities import Aggregation

    engine = engine_for(models("bert"))
    answers = {
        strategy: [
            [(e.label, e.start, e.end, round(e.score, 5)) for e in entities]
            for entities in engine.classify_tokens(NER_TEXTS, _params(aggregation=strategy)).entities
        ]
        for strategy in (Aggregation.FIRST, Aggregation.AVERAGE, Aggregation.MAX)
    }
    assert len({repr(answer) for answer in answers.values()}) == 3


@pytest.mark.parametrize("ignore_labels", [(), ("O", "PER", "B-LOC")])
def test_ignore_labels_equal_the_pipeline(ignore_labels, models, engine_for):
    from embedserv.engine.tasks.entities import Aggregation

    model_dir = models("bert")
    engine = engine_for(model_dir)
    for strategy in ("none", "simple"):
        params = _params(aggregation=Aggregation(strategy), ignore_labels=ignore_labels)
        result = engine.classify_tokens(NER_TEXTS, params)
        expected = pipeline_entities(model_dir, NER_TEXTS, strategy, ignore_labels)
        for index, (entities, reference) in enumerate(zip(result.entities, expected, strict=True)):
            _assert_same_entities(_as_pipeline(entities, strategy), reference, f"{strategy}/{ignore_labels}: {index}")


def test_other_models_refuse_classify_tokens_and_token_classifiers_refuse_other_calls(models, bundled_dir, engine_for):
    from embedserv.errors import InvalidInput
    from embedserv.types import EmbedParams

    with pytest.raises(InvalidInput, match="cannot serve ClassifyTokens; it serves: embed"):
        engine_for(bundled_dir).classify_tokens(["text"])
    tagger = engine_for(models("bert"))
    with pytest.raises(InvalidInput, match="cannot serve Embed; it serves: token_classify"):
        tagger.embed(["text"], EmbedParams())
    with pytest.raises(InvalidInput, match="cannot serve Classify; it serves: token_classify"):
        tagger.classify(["text"])
    with pytest.raises(InvalidInput, match="inputs is empty"):
        tagger.classify_tokens([])


def test_too_long_inputs_are_refused_unless_truncated(models, engine_for):
    from embedserv.errors import InvalidInput

    engine = engine_for(models("bert"))
    long_text = " ".join(["word"] * 200)
    with pytest.raises(InvalidInput, match="more than the model's limit of 128"):
        engine.classify_tokens([long_text])
    result = engine.classify_tokens([long_text], _params(truncate=True))
    assert len(result.tokens[0]) == 126 and result.prompt_tokens == 128
