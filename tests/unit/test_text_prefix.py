"""Truncated inputs tokenized from a prefix give the whole text's ids (engine/inputs/text_prefix.py), for the tokenizer
kinds it accepts, and it refuses the kinds a cut could change."""

from __future__ import annotations

import functools
import random

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from benchmarks.corpus import stdlib_texts
from embedserv.config import ModelConfig, bundled_model_path
from embedserv.engine.inputs import text_prefix
from embedserv.engine.served_model import read_served_model
from embedserv.types import TruncationDirection


@functools.cache
def _texts() -> tuple[str, ...]:
    rng = random.Random(0)
    texts = stdlib_texts(400, seed=1)
    words = ["naïve", "Straße", "日本語の文", "emoji🙂here", "x" * 120, "a-b_c.d", "  ", "\t\n", "über", "[SEP]"]
    texts += [" ".join(rng.choice(words + texts[i].split()[:40]) for _ in range(rng.randint(50, 900)))
              for i in range(200)]  # fmt: skip
    texts += ["word " * 2000, "nospace" * 500, " leading and trailing spaces   " * 80]
    return tuple(texts)


def _fresh(build):
    """`build()` trains once; each call returns a fresh copy of what it trained (a test may change its copy)."""
    trained = functools.cache(lambda *args: build(*args).to_str())
    return functools.wraps(build)(lambda *args: tokenizers.Tokenizer.from_str(trained(*args)))


@_fresh
def _byte_level_bpe() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(stdlib_texts(300, seed=2), trainers.BpeTrainer(vocab_size=500))
    return tokenizer


@_fresh
def _metaspace_unigram(split: bool, num_texts: int = 300) -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(split=split)
    trainer = trainers.UnigramTrainer(vocab_size=400, unk_token="<unk>", special_tokens=["<unk>"])
    tokenizer.train_from_iterator(stdlib_texts(num_texts, seed=3), trainer)
    return tokenizer


def _wordpiece() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    tokenizer.no_truncation()  # as TextTokenizer keeps it (the file truncates and pads to 128)
    tokenizer.no_padding()
    return tokenizer


@pytest.mark.parametrize("build", [_wordpiece, _byte_level_bpe, lambda: _metaspace_unigram(True)],
                         ids=["wordpiece", "byte-level-bpe", "metaspace-unigram"])  # fmt: skip
@pytest.mark.parametrize("room", [8, 126, 510])
def test_the_first_room_tokens_equal_the_whole_texts(build, room):
    backend = build()
    assert text_prefix.cuts_safely(backend)
    texts = list(_texts())
    whole = backend.encode_batch(texts, add_special_tokens=False)
    cut = text_prefix.encode_for_room(backend, texts, room)
    for text, full, mine in zip(texts, whole, cut, strict=True):
        assert mine.ids[:room] == full.ids[:room], text[:80]
        assert len(mine.ids) >= min(room, len(full.ids))
    # The point of it: long texts were not tokenized whole.
    assert sum(len(e.ids) for e in cut) < sum(len(e.ids) for e in whole)


def test_tokenizers_a_cut_could_change_are_tokenized_whole():
    # (Whether a cut is safe depends on the pipeline, not on the vocabulary: a few texts train enough.)
    assert not text_prefix.cuts_safely(_metaspace_unigram(False, 30))
    no_split = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert not text_prefix.cuts_safely(no_split)  # no pre-tokenizer: a token may span whitespace
    spaced = _wordpiece()
    spaced.add_special_tokens(["<end of turn>"])
    assert not text_prefix.cuts_safely(spaced)


def test_prefix_cuts_where_whitespace_starts():
    assert text_prefix.prefix("short", 10) is None
    assert text_prefix.prefix("one two   three four", 9) == "one two"
    assert text_prefix.prefix("onetwothreefour five", 9) is None


def test_the_server_tokenizer_truncates_as_before():
    tokenizer = read_served_model(ModelConfig(path=str(bundled_model_path()), served_name="m")).tokenizer
    texts = list(_texts())
    assert tokenizer._cuts_safely
    ours = [e.ids for e in tokenizer.encode_batch(texts, truncate=True)]
    tokenizer._cuts_safely = False
    assert ours == [e.ids for e in tokenizer.encode_batch(texts, truncate=True)]
    left = [e.ids for e in tokenizer.encode_batch(texts, truncate=True, direction=TruncationDirection.LEFT)]
    assert all(len(ids) <= tokenizer.max_input_tokens for ids in left)
