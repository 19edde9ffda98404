"""Streamed generation text against the full decode, with real tokenizers (bundled WordPiece, and byte-level
BPE and Metaspace tokenizers trained here on a small corpus), plus stop strings."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from embedserv.engine.core.detokenizer import IncrementalDetokenizer, _raw_decoder
from tests.helpers.models import bundled_model_dir

REPLACEMENT_CHAR = "\ufffd"
CORPUS = [
    "Hello world! The weather is nice today, isn't it?",
    "你好，世界。今天天气很好。我们去公园散步吧。",  # noqa: RUF001 - a Chinese text has full-width commas
    "東京は日本の首都です。ラーメンが好きです。",
    "안녕하세요 세계, 반갑습니다.",
    "I love 🍕 and 🎉 parties 😀😀 with friends 👍🏽 and family 👨‍👩‍👧.",
    "Flags 🇯🇵 🇫🇷, a café, naïve façade, Straße and ½ cup of ☕.",
    "Streaming text must never cut a character in half: 🚀 launches, 火箭 发射.",
]


def _common_prefix_len(a: str, b: str) -> int:
    index = 0
    while index < min(len(a), len(b)) and a[index] == b[index]:
        index += 1
    return index


def _reference(tokenizer, prompt_ids, output_ids) -> str:
    """What the generation appends: the full decode after the prompt's decoded text (their common prefix)."""
    full = tokenizer.decode(list(prompt_ids) + list(output_ids), skip_special_tokens=True)
    shown = tokenizer.decode(list(prompt_ids), skip_special_tokens=True)
    return full[_common_prefix_len(full, shown) :]


def _stream(tokenizer, prompt_ids, output_ids, stop=()):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop)
    deltas = [detokenizer.add(token_id) for token_id in output_ids]
    return deltas, detokenizer.flush(), detokenizer


def _train(pre_tokenizer, decoder, **trainer_args) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    trainer = trainers.BpeTrainer(special_tokens=["<eos>"], show_progress=False, **trainer_args)
    tokenizer.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def wordpiece():
    return AutoTokenizer.from_pretrained(str(bundled_model_dir()))


@pytest.fixture(scope="module")
def wordpiece_cleanup():
    """The same tokenizer with transformers' space cleanup ("do n't" -> "don't") switched on."""
    return AutoTokenizer.from_pretrained(str(bundled_model_dir()), clean_up_tokenization_spaces=True)


@pytest.fixture(scope="module")
def byte_level():
    # A small vocabulary keeps most CJK characters and emoji split over several byte tokens.
    return _train(
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )


@pytest.fixture(scope="module")
def metaspace():
    return _train(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
        decoders.Metaspace(replacement="▁", prepend_scheme="always"),
        vocab_size=400,
    )


def test_wordpiece_stream_equals_full_decode(wordpiece):
    prompt = wordpiece("Question: what are sentence embeddings, really?")["input_ids"]  # [CLS] ... [SEP]
    text = "They're dense vectors; tokenization splits 'unbelievably' long words (e.g. embeddings)!"
    output = [*_ids(wordpiece, text), wordpiece.sep_token_id]
    assert any(token.startswith("##") for token in wordpiece.convert_ids_to_tokens(output))
    full = wordpiece.decode(prompt + output, skip_special_tokens=True)
    assert full.startswith(wordpiece.decode(prompt, skip_special_tokens=True))
    deltas, tail, detokenizer = _stream(wordpiece, prompt, output)
    reference = _reference(wordpiece, prompt, output)
    assert reference.startswith(" they")  # the first generated word keeps its space
    assert "".join(deltas) + tail == reference == detokenizer.text
    assert deltas[-1] == "" and not detokenizer.stopped  # [SEP] adds no text


def test_wordpiece_deltas_join_word_pieces(wordpiece):
    output = _ids(wordpiece, "embeddings are fun.")
    assert wordpiece.convert_ids_to_tokens(output) == ["em", "##bed", "##ding", "##s", "are", "fun", "."]
    deltas, tail, _ = _stream(wordpiece, _ids(wordpiece, "hello"), output)
    assert deltas == [" em", "bed", "ding", "s", " are", " fun", "."] and tail == ""


def test_empty_prompt_starts_without_a_space(wordpiece, metaspace):
    for tokenizer in (wordpiece, metaspace):
        output = _ids(tokenizer, "Hello world")
        deltas, tail, _ = _stream(tokenizer, [], output)
        assert "".join(deltas) + tail == tokenizer.decode(output, skip_special_tokens=True)


def test_byte_level_waits_for_whole_characters(byte_level):
    prompt = _ids(byte_level, "Hello world!")
    output = [*_ids(byte_level, " 🦙 llamas 你好 火箭 👍🏽 café"), byte_level.eos_token_id]
    # Characters really are split: some single tokens decode to a partial character.
    assert any(REPLACEMENT_CHAR in byte_level.decode([token_id]) for token_id in output)
    deltas, tail, detokenizer = _stream(byte_level, prompt, output)
    assert "" in deltas[:-1]  # a step that waited for the rest of a character
    assert not any(REPLACEMENT_CHAR in delta for delta in [*deltas, tail])
    expected = " 🦙 llamas 你好 火箭 👍🏽 café"
    assert "".join(deltas) + tail == _reference(byte_level, prompt, output) == expected == detokenizer.text


def test_metaspace_spaces_between_words(metaspace):
    prompt = _ids(metaspace, "Hello world!")
    output = [*_ids(metaspace, "The weather is nice today, isn't it?"), metaspace.eos_token_id]
    assert metaspace.convert_ids_to_tokens(output[:1])[0].startswith("▁")
    deltas, tail, _ = _stream(metaspace, prompt, output)
    expected = " The weather is nice today, isn't it?"
    assert "".join(deltas) + tail == _reference(metaspace, prompt, output) == expected


def test_stop_string_spanning_two_tokens(wordpiece):
    output = _ids(wordpiece, "the answer is forty two. done")
    deltas, tail, detokenizer = _stream(wordpiece, _ids(wordpiece, "q"), output, stop=("forty two",))
    assert detokenizer.text == " the answer is " and detokenizer.stopped
    assert "".join(deltas) + tail == " the answer is "
    assert detokenizer.add(output[0]) == "" and detokenizer.flush() == ""


def test_stop_string_starting_inside_a_token(wordpiece):
    output = _ids(wordpiece, "the answer is forty two")
    deltas, tail, detokenizer = _stream(wordpiece, _ids(wordpiece, "q"), output, stop=("swer is",))
    assert deltas[:2] == [" the", " an"] and set(deltas[2:]) == {""} and tail == ""
    assert detokenizer.text == " the an" and detokenizer.stopped


def test_earliest_stop_string_wins_whatever_its_place_in_the_tuple(wordpiece):
    output = _ids(wordpiece, "the answer is forty two. done")
    for stop in (("done", "is"), ("is", "done")):
        _, _, detokenizer = _stream(wordpiece, _ids(wordpiece, "q"), output, stop=stop)
        assert detokenizer.text == " the answer " and detokenizer.stopped


def test_text_ends_where_a_stop_string_first_completes(wordpiece):
    output = _ids(wordpiece, "the answer is forty two")
    # "swer is forty" starts first, but "is" completes first: the text ends before "is".
    _, _, detokenizer = _stream(wordpiece, _ids(wordpiece, "q"), output, stop=("swer is forty", "is"))
    assert detokenizer.text == " the answer "
    # Both complete at "forty": the one that starts earlier wins.
    _, _, detokenizer = _stream(wordpiece, _ids(wordpiece, "q"), output, stop=("forty", "is forty"))
    assert detokenizer.text == " the answer "


def test_stop_prefix_is_held_then_released(wordpiece):
    output = _ids(wordpiece, "the answer is forty two")
    deltas, tail, detokenizer = _stream(wordpiece, _ids(wordpiece, "q"), output, stop=("is fifty",))
    assert deltas == [" the", " answer", " ", "is forty", " two"] and tail == ""
    assert not detokenizer.stopped


def test_flush_releases_an_unfinished_stop_prefix(wordpiece):
    output = _ids(wordpiece, "the answer is forty two")
    deltas, tail, detokenizer = _stream(wordpiece, _ids(wordpiece, "q"), output, stop=("two three",))
    assert deltas[-1] == " " and tail == "two"
    assert detokenizer.text == " the answer is forty two" and not detokenizer.stopped


def test_special_tokens_produce_no_text(wordpiece):
    detokenizer = IncrementalDetokenizer(wordpiece, _ids(wordpiece, "q"))
    assert detokenizer.add(_ids(wordpiece, "yes")[0]) == " yes"
    assert detokenizer.add(wordpiece.sep_token_id) == "" and detokenizer.add(wordpiece.cls_token_id) == ""
    assert detokenizer.add(_ids(wordpiece, "no")[0]) == " no"  # the space survives the skipped tokens
    assert detokenizer.flush() == "" and detokenizer.text == " yes no"


def test_space_cleanup_matches_the_full_decode(wordpiece_cleanup):
    tokenizer = wordpiece_cleanup
    prompt = tokenizer("what do you think?")["input_ids"]
    output = _ids(tokenizer, "don't worry, it's fine. they've gone, aren't they? yes!")
    reference = _reference(tokenizer, prompt, output)
    assert reference == " don't worry, it's fine. they've gone, aren't they? yes!"
    deltas, tail, _ = _stream(tokenizer, prompt, output)
    assert "".join(deltas) + tail == reference


def test_space_cleanup_joining_prompt_and_output(wordpiece_cleanup):
    # "i don '" + "t" cleans to "i don't": the prompt's text is not a prefix of the full text.
    tokenizer = wordpiece_cleanup
    prompt, output = _ids(tokenizer, "i don'"), _ids(tokenizer, "t know")
    assert tokenizer.decode(prompt) == "i don '"
    deltas, tail, _ = _stream(tokenizer, prompt, output)
    assert "".join(deltas) + tail == _reference(tokenizer, prompt, output) == "'t know"


def test_random_cleanup_sequences_match_the_full_decode(wordpiece_cleanup):
    # Word pieces that form every cleanup pattern ("n't", " 's", " ' ", " ,") in random orders.
    pieces = ["'", "n", "t", "s", "m", "ve", "re", "don", ".", ",", "?", "!", "a", "##s", "##t", "##n"]
    ids = wordpiece_cleanup.convert_tokens_to_ids(pieces)
    rng = random.Random(7)
    for _ in range(300):
        prompt = [rng.choice(ids) for _ in range(rng.randrange(0, 5))]
        output = [rng.choice(ids) for _ in range(rng.randrange(1, 25))]
        deltas, tail, _ = _stream(wordpiece_cleanup, prompt, output)
        assert "".join(deltas) + tail == _reference(wordpiece_cleanup, prompt, output), (prompt, output)


def test_random_text_streams_exactly_and_never_shows_a_broken_character(byte_level):
    rng = random.Random(0)
    sentences = [_ids(byte_level, sentence) for sentence in [*CORPUS, " 🦙🚀 ☕ 火箭 🇫🇷"]]
    for _ in range(200):
        ids = [token_id for _ in range(3) for token_id in rng.choice(sentences)]
        split = rng.randrange(len(ids))
        prompt, output = ids[:split], ids[split:]
        deltas, tail, _ = _stream(byte_level, prompt, output)
        reference = _reference(byte_level, prompt, output)
        assert REPLACEMENT_CHAR not in reference  # the full text is valid UTF-8 ...
        assert "".join(deltas) + tail == reference  # ... and so is everything streamed


def test_random_ids_stream_exactly(byte_level):
    """Random ids include stray UTF-8 bytes: whatever the full decode shows (U+FFFD included), the stream
    shows too; a character left incomplete at the end comes out of flush() as the U+FFFD the decode has."""
    rng = random.Random(1)
    vocab = range(len(byte_level))
    for _ in range(300):
        prompt = [rng.choice(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.choice(vocab) for _ in range(rng.randrange(1, 30))]
        deltas, tail, _ = _stream(byte_level, prompt, output)
        assert "".join(deltas) + tail == _reference(byte_level, prompt, output), (prompt, output)


def _cut_at_first_stop(text: str, stop) -> str:
    """The text up to the first character that completes a stop string, without that stop string."""
    for end in range(1, len(text) + 1):
        found = [text.find(s) for s in stop if s in text[:end]]
        if found:
            return text[: min(found)]
    return text


def test_random_stop_strings(byte_level):
    rng = random.Random(2)
    for _ in range(200):
        output = _ids(byte_level, rng.choice(CORPUS))
        full = _reference(byte_level, [], output)
        stop = tuple(full[start : start + rng.randrange(1, 6)] for start in rng.sample(range(len(full)), 2))
        stop += ("never occurs 🦙",)
        plain = IncrementalDetokenizer(byte_level, [])
        detokenizer = IncrementalDetokenizer(byte_level, [], stop)
        for token_id in output:
            plain.add(token_id)
            detokenizer.add(token_id)
            if detokenizer.stopped:
                break
            # Held back: only what could still begin a stop string.
            held = len(plain.text) - len(detokenizer.text)
            assert plain.text.startswith(detokenizer.text) and held <= max(map(len, stop)) - 1
        detokenizer.flush()
        assert detokenizer.stopped
        assert detokenizer.text == _cut_at_first_stop(full, stop)


class _DecodeSpy:
    """Forwards to a tokenizer and records how many ids each decode call got."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_each_step_decodes_only_a_few_tokens(byte_level):
    ids = [token_id for sentence in CORPUS for token_id in _ids(byte_level, sentence)]
    spy = _DecodeSpy(byte_level)
    detokenizer = IncrementalDetokenizer(spy, ids * 5, stop=("xyz",))
    spy.decoded_lengths.clear()
    for token_id in ids * 5:
        detokenizer.add(token_id)
    # The window: the last release's tokens plus those since; neither outgrows a character's bytes much.
    assert len(ids) * 5 > 500 and max(spy.decoded_lengths) <= 16
    detokenizer.flush()
    assert detokenizer.text == _reference(byte_level, ids * 5, ids * 5)


def test_the_backends_decode_is_transformers_decode_for_plain_fast_tokenizers(wordpiece, byte_level, metaspace):
    """The window decodes through the Rust backend directly where transformers' decode is only a wrapper of it."""
    rng = random.Random(5)
    for tokenizer in (wordpiece, byte_level, metaspace):
        decode = _raw_decoder(tokenizer)
        assert decode.func == tokenizer.backend_tokenizer.decode
        ids = [token_id for sentence in CORPUS for token_id in _ids(tokenizer, sentence)]
        for _ in range(200):
            start = rng.randrange(len(ids))
            window = ids[start : start + rng.randint(1, 9)]
            expected = tokenizer.decode(window, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            assert decode(window) == expected


class _ShoutingTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class with a decode of its own (as Whisper's and CodeGen's have)."""

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs).upper()


def test_a_tokenizer_class_with_its_own_decode_streams_through_it(byte_level):
    shouting = _ShoutingTokenizer(tokenizer_object=byte_level.backend_tokenizer, eos_token="<eos>")
    prompt, output = _ids(shouting, "Hello world!"), _ids(shouting, " The weather is nice today")
    deltas, tail, detokenizer = _stream(shouting, prompt, output)
    assert "".join(deltas) + tail == detokenizer.text == " THE WEATHER IS NICE TODAY"
