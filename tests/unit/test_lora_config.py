"""--lora NAME=PATH on the command line and `lora:` in a --config model entry become ModelConfig.lora; what
cannot name adapters unambiguously is refused before anything loads."""

from __future__ import annotations

import pytest

from embedserv.cli import build_parser
from embedserv.errors import ConfigError
from tests.helpers.configs import serve_config


def test_the_flag_gives_the_model_its_adapters(tmp_path):
    config = serve_config(tmp_path, ["--model", "/m/base", "--lora", "legal=/a/legal", "--lora", "med=/a/med"])
    assert config.models[0].lora == (("legal", "/a/legal"), ("med", "/a/med"))


def test_a_config_file_entry_maps_names_to_paths(tmp_path):
    file = "models:\n  - path: /m/base\n    lora: {legal: /a/legal}\n  - path: /m/other\n"
    config = serve_config(tmp_path, [], file)
    assert config.models[0].lora == (("legal", "/a/legal"),) and config.models[1].lora == ()


def test_a_bad_flag_or_key_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora", "no-equals-sign"])
    assert "NAME=PATH" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="lora must map adapter names"):
        serve_config(tmp_path, [], "models:\n  - path: /m/base\n    lora: [/a/legal]\n")
    with pytest.raises(ConfigError, match="one --model"):
        serve_config(tmp_path, ["--model", "/m/a", "--model", "/m/b", "--lora", "x=/a/x"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/m/base", "--lora", "base=/a/x"], "unique; repeated: base"),
        (["--model", "/m/base", "--lora", "x=/a/x", "--lora", "x=/a/y"], "repeated: x"),
        (["--model", "/m/base", "--lora", "a:b=/a/x"], "without ':'"),
    ],
    ids=["clashes-with-a-model", "twice", "colon"],
)
def test_adapter_names_must_name_one_thing(tmp_path, args, message):
    with pytest.raises(ConfigError, match=message):
        serve_config(tmp_path, args)
