"""Which family runs which Hugging Face model type, and which heads make a model's sparse and token vectors.

Adding a model family is one file in models/families/ (exporting its FAMILY record, and its DOCS for
docs/MODELS.md) and one line in FAMILY_MODULES; adding a head kind is one file in models/heads/ and one entry
in HEAD_KINDS.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.families import (
    bart,
    bert,
    clip,
    colmodernvbert,
    colpali,
    colqwen2,
    deberta_v2,
    distilbert,
    electra,
    eurobert,
    gemma,
    gemma4,
    gte,
    jina_v3,
    llama,
    modernbert,
    mpnet,
    nomic_bert,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_vl,
    siglip,
    siglip2,
    t5,
)
from embedserv.models.heads import bge_m3, multi_vector, splade, token_classifier, vision_retrieval
from embedserv.models.loading.family import Family
from embedserv.models.loading.multi_vector_files import MultiVectorSettings, read_multi_vector_settings

# The family files, each with its FAMILY record and its DOCS (loading/family.FamilyDocs), in table order.
FAMILY_MODULES = (
    bert,
    llama,
    gemma,
    gemma4,
    t5,
    bart,
    nomic_bert,
    gte,
    mpnet,
    distilbert,
    electra,
    deberta_v2,
    modernbert,
    eurobert,
    jina_v3,
    clip,
    siglip,
    siglip2,
    qwen2_vl,
    qwen2_5_vl,
    qwen3_vl,
    colqwen2,
    colpali,
    colmodernvbert,
)
FAMILIES: tuple[Family, ...] = tuple(module.FAMILY for module in FAMILY_MODULES)
_BY_MODEL_TYPE: dict[str, Family] = {model_type: family for family in FAMILIES for model_type in family.model_types}

# T5 checkpoints served by their encoder alone: T5EncoderModel ones, and sentence-transformers models
# (sentence-T5, GTR), which sentence-transformers loads as T5EncoderModel whatever the architecture says.
_T5_ENCODER_ARCHITECTURES = ("T5EncoderModel", "MT5EncoderModel")


# Unserved model types whose architecture is (nearly) one we serve: named in the refusal, as a hint of what
# to convert the model to or which family to ask for. Close spellings are found without this table.
_CLOSEST: dict[str, str] = {
    "jina_bert": "bert (JinaBERT adds ALiBi, which we do not serve)",
    "deberta": "deberta-v2 (DeBERTa v1 has no log buckets)",
    "qwen3_moe": "qwen3 (without mixture-of-experts layers)",
    "mixtral": "mistral (without mixture-of-experts layers)",
}


def _closest(model_type: str) -> str:
    if model_type in _CLOSEST:
        return _CLOSEST[model_type]
    close = difflib.get_close_matches(model_type.lower().replace("_", "-"), list(_BY_MODEL_TYPE), n=1, cutoff=0.6)
    return close[0] if close else ""


def lookup(model_type: str, architecture: str = "", sentence_transformers: bool = False) -> Family:
    """The family of a model type; `architecture` (config.json's first) and `sentence_transformers` (the
    directory has modules.json) pick the encoder alone for T5 embedders."""
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        closest = _closest(model_type)
        raise ConfigError(
            f"model type {model_type!r} is not supported"
            + (f"; the closest served architecture is {closest}" if closest else "")
            + f"; supported: {', '.join(sorted(_BY_MODEL_TYPE))}"
        )
    if family is t5.FAMILY and (architecture in _T5_ENCODER_ARCHITECTURES or sentence_transformers):
        return t5.ENCODER_FAMILY
    return family


def native_config(raw: dict) -> dict | None:
    """A published config.json dict in a form one of our families reads (its model's config_forms,
    models/interface.py) as the native transformers config dict; None when no family reads it as such
    (AutoConfig reads it)."""
    for family in FAMILIES:
        convert = family.model_class.config_forms.get(str(raw.get("model_type")))
        native = convert(raw) if convert is not None else None
        if native is not None:
            return native
    return None


def is_causal(hf_config, family: Family, override: str | None = None) -> bool:
    """Causality from the config: encoders are bidirectional; decoders causal unless `is_causal: false`
    or `use_bidirectional_attention` says so (Gemma 3 and EmbeddingGemma: true; Gemma 4: "all", while
    "vision" leaves text causal).

    `override` ("causal" or "bidirectional", from --attention) wins over all of them.
    """
    if override is not None:
        return override == "causal"
    if family.is_encoder:
        return False
    bidirectional = getattr(hf_config, "use_bidirectional_attention", None)
    if bidirectional is True or bidirectional == "all":
        return False
    return bool(getattr(hf_config, "is_causal", True))


# (ModelSpec, allow_pickle) -> the head module, on the spec's device.
HeadBuilder = Callable[[object, bool], nn.Module]


@dataclass(frozen=True)
class HeadKind:
    """How a model's sparse and token vectors are made (loading/outputs.py names the kind). The worker builds
    its heads from this entry; the engine reads its token rules from the same entry."""

    # None: the model has no sparse output.
    sparse_head: HeadBuilder | None = None
    # None: token vectors are the last hidden states.
    token_head: HeadBuilder | None = None
    # Leading tokens whose vectors are left out (bge-m3's colbert head skips the CLS token).
    skip_first_tokens: int = 0
    # A MultiVectorEncoder's query/document prompts, lengths and masks (engine/tasks/multi_vector.py).
    token_settings: Callable[[object], MultiVectorSettings] | None = None


def _multi_vector_settings(spec) -> MultiVectorSettings:
    return read_multi_vector_settings(spec.model_dir, spec.st, spec.hf_config.hidden_size)


HEAD_KINDS: dict[str, HeadKind] = {
    # A plain embedder: the pooled vector, and its hidden states as token vectors.
    "hidden": HeadKind(),
    "splade": HeadKind(sparse_head=lambda spec, allow_pickle: splade.build_splade_head(spec)),
    "multi_vector_encoder": HeadKind(token_head=multi_vector.build_token_head, token_settings=_multi_vector_settings),
    "bge_m3": HeadKind(sparse_head=bge_m3.build_sparse_head, token_head=bge_m3.build_colbert_head, skip_first_tokens=1),
    # ColQwen2 / ColPali / ColModernVBERT: the projection and L2 norm on every token (queries and page images alike).
    "vision_retrieval": HeadKind(token_head=vision_retrieval.build_projection_head),
    # *ForTokenClassification: the classifier on every token; its "token vectors" are per-token logits.
    "token_classifier": HeadKind(token_head=token_classifier.build_token_classifier_head),
}
_NO_HEADS = HeadKind()


def head_kind(name: str | None) -> HeadKind:
    """The entry of a model's head kind (OutputSpec.head_kind); models without such outputs get no heads."""
    return HEAD_KINDS[name] if name is not None else _NO_HEADS
