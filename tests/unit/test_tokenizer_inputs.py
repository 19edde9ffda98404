"""The tokenizer's paths for the HTTP APIs: token-id inputs, chat templates and decode."""

from __future__ import annotations

import shutil

import pytest

from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.errors import InvalidInput
from embedserv.types import TruncationDirection


@pytest.fixture(scope="module")
def tokenizer(bundled_dir) -> TextTokenizer:
    return TextTokenizer(bundled_dir, max_input_tokens=8)


def test_token_ids_are_used_as_given_and_cut_or_refused(tokenizer):
    (kept,) = tokenizer.check_token_ids([[101, 7592, 102]], truncate=False, direction=TruncationDirection.RIGHT)
    assert kept.ids == [101, 7592, 102]
    long = list(range(100, 112))
    (right,) = tokenizer.check_token_ids([long], truncate=True, direction=TruncationDirection.RIGHT)
    (left,) = tokenizer.check_token_ids([long], truncate=True, direction=TruncationDirection.LEFT)
    assert right.ids == long[:8] and left.ids == long[-8:]
    with pytest.raises(InvalidInput, match="more than"):
        tokenizer.check_token_ids([long], truncate=False, direction=TruncationDirection.RIGHT)
    with pytest.raises(InvalidInput, match="outside the model's vocabulary.*check_embedding_ctx_length=False"):
        tokenizer.check_token_ids([[101, 10**9]], truncate=False, direction=TruncationDirection.RIGHT)
    with pytest.raises(InvalidInput, match="no token ids"):
        tokenizer.check_token_ids([[]], truncate=False, direction=TruncationDirection.RIGHT)


def test_chat_without_a_template_is_refused_with_what_to_do(tokenizer):
    with pytest.raises(InvalidInput, match="no chat template.*/v1/completions"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_renders_with_the_generation_prompt(bundled_dir, tmp_path):
    import json

    model_dir = tmp_path / "with-template"
    shutil.copytree(bundled_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}bot={% endif %}"
    )
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = TextTokenizer(model_dir, max_input_tokens=8).apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "user=hi;bot="


def test_decode_checks_ids(tokenizer):
    assert tokenizer.decode([101, 7592, 102], skip_special_tokens=True) == "hello"
    assert tokenizer.decode([101, 7592, 102], skip_special_tokens=False) == "[CLS] hello [SEP]"
    with pytest.raises(InvalidInput, match="outside"):
        tokenizer.decode([-1], skip_special_tokens=True)
