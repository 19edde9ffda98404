"""docs/MODELS.md is what docs/models_table.py writes from the registry, and every family it lists says
which published models it serves and which tests show it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from embedserv.errors import ConfigError
from embedserv.models import registry

ROOT = Path(__file__).resolve().parents[2]


def _table_module():
    spec = importlib.util.spec_from_file_location("models_table", ROOT / "docs" / "models_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_models_doc_is_not_stale():
    table = _table_module()
    assert (ROOT / "docs" / "MODELS.md").read_text() == table.render(), (
        "docs/MODELS.md is stale: run `make models-doc` (python docs/models_table.py)"
    )


@pytest.mark.parametrize("module", registry.FAMILY_MODULES, ids=lambda m: m.FAMILY.name)
def test_every_family_names_the_tests_that_show_it(module):
    family = module.FAMILY
    assert module.DOCS.tested_by, f"{family.name} names no test files"
    for path in module.DOCS.tested_by:
        assert (ROOT / path).is_file(), f"{family.name}: {path} does not exist"


def test_every_model_type_has_one_family():
    seen: dict[str, str] = {}
    for family in registry.FAMILIES:
        for model_type in family.model_types:
            assert model_type not in seen, f"{model_type} is served by {seen[model_type]} and {family.name}"
            seen[model_type] = family.name


@pytest.mark.parametrize(
    ("model_type", "closest"),
    [("qwen3_moe", "qwen3"), ("mixtral", "mistral"), ("robertta", "roberta"), ("jina_bert", "bert")],
)
def test_an_unknown_model_type_names_the_closest_served_one(model_type, closest):
    with pytest.raises(ConfigError) as caught:
        registry.lookup(model_type)
    message = str(caught.value)
    assert f"model type {model_type!r} is not supported" in message
    assert f"the closest served architecture is {closest}" in message
    assert "bert" in message.split("supported:")[-1]


def test_a_model_type_like_none_served_names_no_closest():
    with pytest.raises(ConfigError) as caught:
        registry.lookup("wav2vec2")
    assert "closest" not in str(caught.value)
