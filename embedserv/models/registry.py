"""Which native class runs which Hugging Face model type, and what attention it uses by default."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.bert import BertModel
from embedserv.models.llama import LlamaModel


@dataclass(frozen=True)
class ModelEntry:
    model_class: type[nn.Module]
    # Encoders attend both ways; decoders are causal unless their config says otherwise.
    is_encoder: bool


_MODELS: dict[str, ModelEntry] = {
    "bert": ModelEntry(BertModel, is_encoder=True),
    "roberta": ModelEntry(BertModel, is_encoder=True),
    "xlm-roberta": ModelEntry(BertModel, is_encoder=True),
    "camembert": ModelEntry(BertModel, is_encoder=True),
    "llama": ModelEntry(LlamaModel, is_encoder=False),
    "mistral": ModelEntry(LlamaModel, is_encoder=False),
    "qwen2": ModelEntry(LlamaModel, is_encoder=False),
    "qwen3": ModelEntry(LlamaModel, is_encoder=False),
}


def lookup(model_type: str) -> ModelEntry:
    entry = _MODELS.get(model_type)
    if entry is None:
        raise ConfigError(
            f"model type {model_type!r} is not supported; supported: {', '.join(sorted(_MODELS))}"
        )
    return entry


def is_causal(hf_config, entry: ModelEntry, override: str | None = None) -> bool:
    """Causality from the config: encoders are bidirectional; decoders causal unless `is_causal: false`.

    `override` ("causal" or "bidirectional", from --attention) wins over both.
    """
    if override is not None:
        return override == "causal"
    if entry.is_encoder:
        return False
    return bool(getattr(hf_config, "is_causal", True))
