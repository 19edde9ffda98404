"""Reads a sentence-transformers model directory: modules, pooling, dense layers, prompts, limits.

Handles both the files sentence-transformers 2.x-5.x wrote (`pooling_mode_*_tokens` flags,
`max_seq_length` in sentence_bert_config.json) and 6.x (`pooling_mode`, `include_prompt`, the length in
tokenizer_config.json). A plain Hugging Face directory (no modules.json) is read as Transformer only.

Four module arrangements are understood, and any other stops start-up with a message:
- SentenceTransformer: Transformer, Pooling, then Dense layers and Normalize (on the pooled vector);
- SparseEncoder: Transformer (fill-mask) or MLMTransformer, then SpladePooling;
- MultiVectorEncoder (its config_sentence_transformers.json says so): Transformer, then Dense layers and
  Normalize on every token's vector, and optionally MultiVectorMask.
- CrossEncoder: the Transformer alone (its *ForSequenceClassification checkpoint does the rest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from embedserv.errors import ConfigError

_LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
SUPPORTED_POOLING = ("cls", "mean", "max", "lasttoken")
# sentence-transformers Dense activations by their saved class path suffix.
DENSE_ACTIVATIONS = ("Identity", "Tanh", "ReLU", "GELU", "Sigmoid", "SiLU")


@dataclass(frozen=True)
class DenseSpec:
    in_features: int
    out_features: int
    bias: bool
    activation: str
    directory: Path


@dataclass(frozen=True)
class SpladeSpec:
    """SpladePooling: log1p(activation(MLM logits)) pooled over the tokens."""

    # "max" or "sum" over the tokens; "relu" or "log1p_relu" (a second log1p) before it.
    pooling: str = "max"
    activation: str = "relu"


@dataclass(frozen=True)
class MultiVectorFiles:
    """A MultiVectorEncoder's token-level modules after the Transformer."""

    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False
    # MultiVectorMask's config (skiplist_words, skiplist_tasks, keep_only_token_ids); None without the module.
    mask: dict | None = None


SENTENCE_TRANSFORMER, SPARSE_ENCODER, MULTI_VECTOR_ENCODER = (
    "SentenceTransformer",
    "SparseEncoder",
    "MultiVectorEncoder",
)
# A CrossEncoder directory (v6 saves modules.json too) is its *ForSequenceClassification checkpoint.
CROSS_ENCODER = "CrossEncoder"


@dataclass(frozen=True)
class SentenceTransformerFiles:
    # SentenceTransformer, SparseEncoder or MultiVectorEncoder (config_sentence_transformers.json's model_type).
    model_type: str = SENTENCE_TRANSFORMER
    # None when the directory has no Pooling module (a plain Hugging Face model).
    pooling: str | None = None
    # False excludes prompt tokens from pooling.
    include_prompt: bool = True
    dense: tuple[DenseSpec, ...] = ()
    # From sentence_bert_config.json (older files); None defers to the tokenizer's limit.
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    # SparseEncoder: its SpladePooling; MultiVectorEncoder: its token-level modules.
    splade: SpladeSpec | None = None
    multi_vector: MultiVectorFiles | None = None
    # sentence_bert_config.json as saved (the Transformer module's settings: lengths, query expansion, ...).
    transformer_config: dict = field(default_factory=dict)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def _module_kind(module_type: str, modules_path: Path, transformer_modules: tuple[str, ...]) -> str:
    """Transformer, Pooling, Dense, Normalize, ... of sentence-transformers' own modules. A module of another
    package is custom code: a class named Pooling there may pool differently, and its code never runs here.
    `transformer_modules` are the custom types the model's family reads as Transformer."""
    if module_type in transformer_modules:
        return "Transformer"
    if not module_type.startswith("sentence_transformers."):
        raise ConfigError(
            f"{modules_path}: module {module_type} is custom code, not a sentence-transformers module; "
            "embedserv never runs a model's own code"
        )
    return module_type.rsplit(".", 1)[-1]


def read_pooling(config: dict, path: Path) -> tuple[str, bool]:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in _LEGACY_POOLING_FLAGS.items() if config.get(flag)]
        if len(modes) != 1:
            raise ConfigError(f"{path}: exactly one pooling mode must be set, found {modes or 'none'}")
        mode = modes[0]
    if isinstance(mode, list):
        if len(mode) != 1:
            raise ConfigError(f"{path}: concatenated pooling modes {mode} are not supported")
        mode = mode[0]
    if mode not in SUPPORTED_POOLING:
        raise ConfigError(f"{path}: pooling mode {mode!r} is not supported; supported: {', '.join(SUPPORTED_POOLING)}")
    return mode, bool(config.get("include_prompt", True))


def read_dense(directory: Path) -> DenseSpec:
    config = _read_json(directory / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
    if activation not in DENSE_ACTIVATIONS:
        raise ConfigError(f"{directory}: Dense activation {activation!r} is not supported")
    return DenseSpec(
        in_features=int(config["in_features"]),
        out_features=int(config["out_features"]),
        bias=bool(config.get("bias", True)),
        activation=activation,
        directory=directory,
    )


def read_splade(directory: Path) -> SpladeSpec:
    config = _read_json(directory / "config.json")
    spec = SpladeSpec(str(config.get("pooling_strategy", "max")), str(config.get("activation_function", "relu")))
    if spec.pooling not in ("max", "sum") or spec.activation not in ("relu", "log1p_relu"):
        raise ConfigError(
            f"{directory}: SpladePooling {spec.pooling}/{spec.activation} is not supported; pooling_strategy must "
            "be max or sum and activation_function relu or log1p_relu"
        )
    return spec


_ARRANGEMENTS = {
    SENTENCE_TRANSFORMER: "Transformer, Pooling, then Dense and Normalize",
    SPARSE_ENCODER: "Transformer (fill-mask) or MLMTransformer, then SpladePooling",
    MULTI_VECTOR_ENCODER: "Transformer, then Dense and Normalize on token vectors, then MultiVectorMask",
    CROSS_ENCODER: "Transformer alone",
}
# The modules each arrangement allows after its Transformer, in order (a module may repeat or be absent).
_ORDER = {
    SENTENCE_TRANSFORMER: ("Pooling", "Dense", "Normalize"),
    SPARSE_ENCODER: ("SpladePooling",),
    MULTI_VECTOR_ENCODER: ("Dense", "Normalize", "MultiVectorMask"),
    CROSS_ENCODER: (),
}


def _check_arrangement(model_type: str, kinds: list[str], modules_path: Path) -> None:
    """Refuses any module sequence but the arrangements above: one we misread would serve wrong vectors."""
    order = _ORDER[model_type]
    # MultiVectorMask only rewrites which tokens score, so it may sit anywhere after the Transformer (the
    # library's own default puts it before Normalize).
    ranked = [kind for kind in kinds[1:] if not (model_type == MULTI_VECTOR_ENCODER and kind == "MultiVectorMask")]
    rank = [order.index(kind) if kind in order else -1 for kind in ranked]
    ok = (
        bool(kinds)
        and kinds[0] in ("Transformer", "MLMTransformer")
        and -1 not in rank
        and rank == sorted(rank)
        and (model_type != SENTENCE_TRANSFORMER or not rank or rank[0] == 0)  # Dense/Normalize need a Pooling first
        and (model_type != SPARSE_ENCODER or rank == [0])
        and kinds.count("Pooling") <= 1
        and kinds.count("Normalize") <= 1
        and kinds.count("MultiVectorMask") <= 1
    )
    if not ok:
        raise ConfigError(
            f"{modules_path}: the modules {' -> '.join(kinds)} are not an arrangement embedserv serves as a "
            f"{model_type} (it serves {_ARRANGEMENTS[model_type]})"
        )


# sentence-transformers before 5.4 saved CLIP as its CLIPModel module in a folder (0_CLIPModel/) holding the whole
# Hugging Face directory, embedding texts and images as that model's get_text / get_image_features do.
_FOLDER_CLIP = "sentence_transformers.models.CLIPModel"


def model_root(model_dir: Path) -> Path:
    """Where the model's own files are: the directory, or a CLIPModel module's folder (then only a Normalize
    may follow it, which the call's `normalize` does)."""
    modules_path = model_dir / "modules.json"
    if (model_dir / "config.json").exists() or not modules_path.exists():
        return model_dir
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not modules or modules[0].get("type") != _FOLDER_CLIP:
        return model_dir
    rest = [str(module.get("type", "")) for module in modules[1:]]
    if any(not kind.endswith(".Normalize") for kind in rest):
        raise ConfigError(f"{modules_path}: CLIPModel followed by {', '.join(rest)} is not served (only Normalize)")
    return model_dir / str(modules[0].get("path", ""))


def read_sentence_transformers(model_dir: Path, transformer_modules: tuple[str, ...] = ()) -> SentenceTransformerFiles:
    modules_path = model_dir / "modules.json"
    if not modules_path.exists():
        return SentenceTransformerFiles()
    prompts_path = model_dir / "config_sentence_transformers.json"
    prompts_config = _read_json(prompts_path) if prompts_path.exists() else {}
    model_type = str(prompts_config.get("model_type") or SENTENCE_TRANSFORMER)
    if model_type not in _ORDER:
        raise ConfigError(f"{prompts_path}: model_type {model_type!r} is not served; served: {', '.join(_ORDER)}")
    bert_config = model_dir / "sentence_bert_config.json"
    st_config = _read_json(bert_config) if bert_config.exists() else {}
    pooling, include_prompt, splade, mask, normalize = None, True, None, None, False
    dense: list[DenseSpec] = []
    kinds = []
    for module in _read_json(modules_path):
        kind = _module_kind(module["type"], modules_path, transformer_modules)
        kinds.append(kind)
        directory = model_dir / module.get("path", "")
        if kind in ("Transformer", "MLMTransformer"):
            if module.get("path", ""):
                raise ConfigError(f"{modules_path}: the Transformer module must sit in the model's root directory")
        elif kind == "Pooling":
            pooling, include_prompt = read_pooling(_read_json(directory / "config.json"), directory)
        elif kind == "Dense":
            dense.append(read_dense(directory))
        elif kind == "SpladePooling":
            splade = read_splade(directory)
        elif kind == "MultiVectorMask":
            mask = _read_json(directory / "config.json") if (directory / "config.json").exists() else {}
        elif kind == "Normalize":
            normalize = True
        else:
            raise ConfigError(f"{modules_path}: module {module['type']} is not supported")
    _check_arrangement(model_type, kinds, modules_path)
    fill_mask = kinds[0] == "MLMTransformer" or st_config.get("transformer_task") == "fill-mask"
    if (model_type == SPARSE_ENCODER) != fill_mask:
        raise ConfigError(
            f"{modules_path}: a {model_type} with a {'fill-mask' if fill_mask else 'feature-extraction'} "
            "Transformer is not served (SparseEncoder directories need the fill-mask task, others must not use it)"
        )
    multi_vector = None
    if model_type == MULTI_VECTOR_ENCODER:
        multi_vector, dense = MultiVectorFiles(tuple(dense), normalize, mask), []
    return SentenceTransformerFiles(
        model_type=model_type,
        pooling=pooling,
        include_prompt=include_prompt,
        dense=tuple(dense),
        max_seq_length=st_config.get("max_seq_length"),
        do_lower_case=bool(st_config.get("do_lower_case", False)),
        prompts=dict(prompts_config.get("prompts") or {}),
        default_prompt_name=prompts_config.get("default_prompt_name") or None,
        splade=splade,
        multi_vector=multi_vector,
        transformer_config=st_config,
    )
