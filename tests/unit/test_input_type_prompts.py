"""Cohere's input_type -> prompt map of a model: --input-type-prompt TYPE=PROMPT and a model's `input_types:` become
ModelConfig.input_types and, checked against the model's prompts at start-up, ModelInfo.input_type_prompts; the
types configured pick their prompt and the others keep cohere.py's defaults."""

from __future__ import annotations

import json
import typing
from dataclasses import asdict, replace

import pytest

from embedserv.cli import build_parser
from embedserv.config import COHERE_INPUT_TYPES, ModelConfig
from embedserv.errors import ConfigError
from embedserv.models.loading.spec_reader import read_model_spec
from embedserv.server.http import cohere
from embedserv.types import ModelInfo, Task
from tests.helpers.configs import serve_config
from tests.helpers.prompted_models import prompted_minilm

PROMPTS = {"query": "query: ", "passage": "passage: ", "topic": "topic: "}


def test_the_flag_and_the_key_give_the_model_its_map(tmp_path):
    args = ["--model", "/m/a", "--input-type-prompt", "search_query=topic", "--input-type-prompt", "clustering=query"]
    assert serve_config(tmp_path, args).models[0].input_types == (("search_query", "topic"), ("clustering", "query"))
    file = (
        "defaults:\n  input_types: {classification: topic}\n"
        "models:\n  - path: /m/a\n    input_types: {search_query: topic}\n  - path: /m/b\n"
    )
    first, second = serve_config(tmp_path, [], file).models
    # A model's own mapping replaces defaults:'s, as any key of its entry does.
    assert first.input_types == (("search_query", "topic"),) and second.input_types == (("classification", "topic"),)


def test_configured_types_win_and_the_others_keep_the_defaults():
    info = ModelInfo(
        name="m", tasks=(Task.EMBED,), architecture="BertModel", is_causal=False, pooling="mean", dimension=8,
        max_input_tokens=128, prompt_names=tuple(sorted(PROMPTS)), dtype="float32", device="cpu",
        attention_backend="sdpa", input_type_prompts=(("search_query", "topic"), ("clustering", "query")),
    )  # fmt: skip
    assert cohere.prompt_for(info, "search_query") == "topic"  # its default would be the model's query prompt
    assert cohere.prompt_for(info, "clustering") == "query"  # no default
    assert cohere.prompt_for(info, "search_document") == "passage"  # not configured: the default
    assert cohere.prompt_for(info, "classification") is None and cohere.prompt_for(info, None) is None
    assert cohere.prompt_for(replace(info, input_type_prompts=()), "search_query") == "query"


def test_cohere_and_the_config_know_the_same_input_types():
    assert set(typing.get_args(cohere.InputType)) == set(cohere._PROMPTS) == set(COHERE_INPUT_TYPES)


@pytest.mark.parametrize(
    "args, file, message",
    [
        (["--input-type-prompt", "search=query"], None, "'search' is no Cohere input_type; give one of search_query"),
        (["--input-type-prompt", "image=a", "--input-type-prompt", "image=b"], None, "maps image more than once"),
        ([], "models:\n  - path: /m/a\n    input_types: [query]\n", "input_types must map Cohere input types"),
        (
            [],
            "models:\n  - path: /m/a\n    input_types: {search: query}\n",
            r"embedserv.yaml: models\[0\] \(/m/a\): input_types search=query: 'search' is no Cohere input_type",
        ),
    ],
    ids=["unknown-type", "twice", "not-a-mapping", "unknown-type-in-the-file"],
)
def test_a_bad_map_is_refused(tmp_path, args, file, message):
    with pytest.raises(ConfigError, match=message):
        serve_config(tmp_path, args, file)


def test_a_flag_without_a_prompt_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--input-type-prompt", "search_query"])
    assert "TYPE=PROMPT" in capsys.readouterr().err


def test_a_prompt_the_model_lacks_stops_start_up(tmp_path):
    model = prompted_minilm(tmp_path, PROMPTS)
    (config,) = serve_config(tmp_path, ["--model", str(model), "--input-type-prompt", "search_query=question"]).models
    with pytest.raises(ConfigError, match=r"prompt 'question' .*does not have; its prompts: passage, query, topic"):
        read_model_spec(config)
    (config,) = serve_config(tmp_path, ["--model", str(model), "--input-type-prompt", "search_query=topic"]).models
    assert read_model_spec(config).info.input_type_prompts == (("search_query", "topic"),)
    # Worker processes get the ModelConfig as JSON (executor/worker_main.py): pairs come back as lists.
    from_json = ModelConfig(**json.loads(json.dumps(asdict(config))))
    assert read_model_spec(from_json).info.input_type_prompts == (("search_query", "topic"),)
