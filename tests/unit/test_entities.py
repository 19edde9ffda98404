"""Token classification's entity aggregation (engine/tasks/entities.py) on hand-made tokens: the pipeline's rules
for each strategy, word detection, and ignore_labels. (tests/models/test_token_classify_parity.py checks the same
functions against transformers' pipeline on real models.)"""

from __future__ import annotations

import numpy as np
import pytest

from embedserv.engine.tasks.entities import Aggregation, Entity, TokenScores, aggregate, softmax, token_scores

LABELS = ("O", "B-ORG", "I-ORG", "B-PER", "I-PER")


def _probs(best: int, score: float) -> np.ndarray:
    rest = (1.0 - score) / (len(LABELS) - 1)
    row = np.full(len(LABELS), rest, dtype=np.float32)
    row[best] = score
    return row


def _token(index: int, word: str, start: int, best: int, score: float, subword: bool = False) -> TokenScores:
    return TokenScores(index, word, start, start + len(word.removeprefix("##")), subword, _probs(best, score))


def _wordpiece(tokens: list[str]) -> str:
    """tokenizers' WordPiece decoder (its cleanup aside)."""
    from tokenizers import decoders

    return decoders.WordPiece().decode(tokens)


# "micro ##soft com ##pany": the pipeline docstring's example, B-ORG I-PER I-ORG I-ORG.
MICROSOFT = [
    _token(1, "micro", 0, best=1, score=0.9),
    _token(2, "##soft", 5, best=4, score=0.6, subword=True),
    _token(3, "com", 10, best=2, score=0.7),
    _token(4, "##pany", 13, best=2, score=0.8, subword=True),
]


def _run(strategy: Aggregation, tokens=MICROSOFT, **kwargs) -> list[Entity]:
    return aggregate(tokens, LABELS, strategy, tokens_to_string=_wordpiece, **kwargs)


def test_none_gives_one_entity_per_token_with_its_index():
    entities = _run(Aggregation.NONE)
    assert [(e.label, e.word, e.index, e.start, e.end) for e in entities] == [
        ("B-ORG", "micro", 1, 0, 5),
        ("I-PER", "##soft", 2, 5, 9),
        ("I-ORG", "com", 3, 10, 13),
        ("I-ORG", "##pany", 4, 13, 17),
    ]
    assert entities[0].score == pytest.approx(0.9)


def test_simple_splits_a_word_whose_pieces_disagree():
    entities = _run(Aggregation.SIMPLE)
    assert [(e.label, e.word, e.start, e.end) for e in entities] == [
        ("ORG", "micro", 0, 5),
        # The decoder keeps a word-leading `##` (tokenizers' WordPiece decoder strips it only after a token).
        ("PER", "##soft", 5, 9),
        ("ORG", "company", 10, 17),
    ]
    assert entities[2].score == pytest.approx(0.75)
    assert all(e.index is None for e in entities)


def test_first_gives_each_word_its_first_token_label():
    entities = _run(Aggregation.FIRST)
    assert [(e.label, e.word, e.start, e.end) for e in entities] == [("ORG", "microsoft company", 0, 17)]
    # The mean over the two words' scores: micro's 0.9 and com's 0.7.
    assert entities[0].score == pytest.approx(0.8)


def test_max_takes_the_most_confident_token_of_a_word():
    tokens = [
        _token(1, "micro", 0, best=1, score=0.5),
        _token(2, "##soft", 5, best=3, score=0.9, subword=True),
    ]
    entities = _run(Aggregation.MAX, tokens)
    assert [(e.label, e.word, e.score) for e in entities] == [("PER", "microsoft", pytest.approx(0.9))]


def test_average_takes_the_best_label_of_the_mean_probabilities():
    # micro: ORG 0.5, ##soft: PER 0.6 and ORG 0.4 -> the mean favours ORG (0.45 against 0.3625).
    first = _probs(1, 0.5)
    second = np.array([0.0, 0.4, 0.0, 0.6, 0.0], dtype=np.float32)
    tokens = [TokenScores(1, "micro", 0, 5, False, first), TokenScores(2, "##soft", 5, 9, True, second)]
    entities = _run(Aggregation.AVERAGE, tokens)
    assert [(e.label, e.word) for e in entities] == [("ORG", "microsoft")]
    assert entities[0].score == pytest.approx(0.45)
    # MAX picks the PER token instead: the strategies differ on this word.
    assert _run(Aggregation.MAX, tokens)[0].label == "PER"


def test_a_b_label_starts_a_new_group_and_other_labels_group_by_name():
    labels = ("O", "B-PER", "I-PER", "MISC")
    tokens = [
        TokenScores(1, "ann", 0, 3, False, np.eye(4, dtype=np.float32)[1]),
        TokenScores(2, "bob", 4, 7, False, np.eye(4, dtype=np.float32)[1]),
        TokenScores(3, "lee", 8, 11, False, np.eye(4, dtype=np.float32)[2]),
        TokenScores(4, "x", 12, 13, False, np.eye(4, dtype=np.float32)[3]),
        TokenScores(5, "y", 14, 15, False, np.eye(4, dtype=np.float32)[3]),
    ]
    entities = aggregate(tokens, labels, Aggregation.SIMPLE, tokens_to_string=_wordpiece)
    assert [(e.label, e.word) for e in entities] == [("PER", "ann"), ("PER", "bob lee"), ("MISC", "x y")]


def test_ignore_labels_default_drops_o_and_an_empty_list_keeps_everything():
    tokens = [_token(1, "the", 0, best=0, score=0.9), _token(2, "acme", 4, best=1, score=0.8)]
    assert [e.label for e in _run(Aggregation.NONE, tokens)] == ["B-ORG"]
    assert [e.label for e in _run(Aggregation.SIMPLE, tokens)] == ["ORG"]
    assert [e.label for e in _run(Aggregation.SIMPLE, tokens, ignore_labels=())] == ["O", "ORG"]
    assert _run(Aggregation.NONE, tokens, ignore_labels=("O", "B-ORG")) == []


def test_word_aware_tokenizers_find_subwords_by_length_and_others_by_spaces():
    text = "Hello world-wide"
    tokens = ["hello", "world", "-", "wide"]
    offsets = [(0, 5), (6, 11), (11, 12), (12, 16)]
    probs = softmax(np.zeros((4, len(LABELS)), dtype=np.float32))
    special = [False] * 4
    aware = token_scores(text, tokens, [5, 6, 7, 8], offsets, special, probs, word_aware=True, unk_id=100)
    # WordPiece: only a `##` piece (longer than its text) continues a word; "-" and "wide" are words of their own.
    assert [t.is_subword for t in aware] == [False, False, False, False]
    pieces = token_scores(
        text, ["hello", "wor", "##ld"], [5, 9, 10], [(0, 5), (6, 9), (9, 11)], special[:3], probs[:3], True, 100
    )
    assert [t.is_subword for t in pieces] == [False, False, True]
    # Otherwise: a token with no space just before it (and not at the start) continues a word.
    guessed = token_scores(text, tokens, [5, 6, 7, 8], offsets, special, probs, word_aware=False, unk_id=100)
    assert [t.is_subword for t in guessed] == [False, False, True, True]


def test_special_tokens_are_left_out_and_unknown_tokens_take_their_text():
    text = "a ☃ b"
    tokens = ["[CLS]", "a", "[UNK]", "b", "[SEP]"]
    offsets = [(0, 0), (0, 1), (2, 3), (4, 5), (0, 0)]
    special = [True, False, False, False, True]
    probs = softmax(np.random.default_rng(0).normal(size=(5, len(LABELS))).astype(np.float32))
    out = token_scores(text, tokens, [101, 7, 100, 8, 102], offsets, special, probs, word_aware=True, unk_id=100)
    assert [(t.index, t.word, t.is_subword) for t in out] == [(1, "a", False), (2, "☃", False), (3, "b", False)]
    np.testing.assert_array_equal(out[1].scores, probs[2])


def test_softmax_rows_sum_to_one_in_float32():
    logits = np.array([[1000.0, 0.0], [0.0, 0.0]], dtype=np.float32)
    probs = softmax(logits)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs, [[1.0, 0.0], [0.5, 0.5]])


def test_an_unknown_strategy_name_is_refused():
    with pytest.raises(ValueError):
        Aggregation("longest")
