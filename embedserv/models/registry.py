"""Which native class runs which Hugging Face model type, and what attention it uses by default."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.bart import BartModel
from embedserv.models.bert import BertModel
from embedserv.models.gemma import Gemma3Model
from embedserv.models.gemma4 import Gemma4Model
from embedserv.models.llama import LlamaModel
from embedserv.models.t5 import T5EncoderModel, T5Model


@dataclass(frozen=True)
class ModelEntry:
    model_class: type[nn.Module]
    # Encoders attend both ways; decoders are causal unless their config says otherwise.
    is_encoder: bool
    # Encoder-decoders (T5, BART): an encoder over the encoder inputs, a causal decoder reading it.
    is_encoder_decoder: bool = False


_MODELS: dict[str, ModelEntry] = {
    "bert": ModelEntry(BertModel, is_encoder=True),
    "roberta": ModelEntry(BertModel, is_encoder=True),
    "xlm-roberta": ModelEntry(BertModel, is_encoder=True),
    "camembert": ModelEntry(BertModel, is_encoder=True),
    "llama": ModelEntry(LlamaModel, is_encoder=False),
    "mistral": ModelEntry(LlamaModel, is_encoder=False),
    "qwen2": ModelEntry(LlamaModel, is_encoder=False),
    "qwen3": ModelEntry(LlamaModel, is_encoder=False),
    "gemma3_text": ModelEntry(Gemma3Model, is_encoder=False),
    "gemma4_text": ModelEntry(Gemma4Model, is_encoder=False),
    "t5": ModelEntry(T5Model, is_encoder=False, is_encoder_decoder=True),
    "mt5": ModelEntry(T5Model, is_encoder=False, is_encoder_decoder=True),
    "bart": ModelEntry(BartModel, is_encoder=False, is_encoder_decoder=True),
    "mbart": ModelEntry(BartModel, is_encoder=False, is_encoder_decoder=True),
}

# T5 checkpoints served by their encoder alone: T5EncoderModel ones, and sentence-transformers models
# (sentence-T5, GTR), which sentence-transformers loads as T5EncoderModel whatever the architecture says.
_T5_ENCODER = ModelEntry(T5EncoderModel, is_encoder=True)
_T5_TYPES = ("t5", "mt5")
_T5_ENCODER_ARCHITECTURES = ("T5EncoderModel", "MT5EncoderModel")


def lookup(model_type: str, architecture: str = "", sentence_transformers: bool = False) -> ModelEntry:
    """The native class for a model type; `architecture` (config.json's first) and `sentence_transformers`
    (the directory has modules.json) pick the encoder alone for T5 embedders."""
    entry = _MODELS.get(model_type)
    if entry is None:
        raise ConfigError(
            f"model type {model_type!r} is not supported; supported: {', '.join(sorted(_MODELS))}"
        )
    if model_type in _T5_TYPES and (architecture in _T5_ENCODER_ARCHITECTURES or sentence_transformers):
        return _T5_ENCODER
    return entry


def is_causal(hf_config, entry: ModelEntry, override: str | None = None) -> bool:
    """Causality from the config: encoders are bidirectional; decoders causal unless `is_causal: false`
    or `use_bidirectional_attention` says so (Gemma 3 and EmbeddingGemma: true; Gemma 4: "all", while
    "vision" leaves text causal).

    `override` ("causal" or "bidirectional", from --attention) wins over all of them.
    """
    if override is not None:
        return override == "causal"
    if entry.is_encoder:
        return False
    bidirectional = getattr(hf_config, "use_bidirectional_attention", None)
    if bidirectional is True or bidirectional == "all":
        return False
    return bool(getattr(hf_config, "is_causal", True))
