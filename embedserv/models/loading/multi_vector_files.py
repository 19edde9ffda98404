"""sentence-transformers MultiVectorEncoder directories (ColBERT-style): their settings (heads/multi_vector.py
builds the token head from them).

A MultiVectorEncoder runs its Transformer, then its Dense layers and Normalize on every token's vector;
MultiVectorMask then picks the tokens that are returned and scored. What it reads (as 6.2 saves it):

- sentence_bert_config.json: query_length / document_length (each task's token cap) and query_expansion
  (ColBERT's [MASK] padding of queries to `length` tokens, "fixed" or "min");
- each Dense's and Normalize's config.json (they must act on `token_embeddings`);
- MultiVectorMask's config.json: skiplist_words on the skiplist_tasks, keep_only_token_ids;
- config_sentence_transformers.json: similarity_fn_name (maxsim, or meanmaxsim: divided by the query's
  token count).

Whatever would make the library's vectors differ from ours stops start-up with a ConfigError that says
what and why, rather than serving other vectors. The tokenizer-dependent checks (the expansion token, the
skiplist) are made by the engine's MultiVectorRules (engine/tasks/multi_vector.py), also at start-up.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from embedserv.errors import ConfigError
from embedserv.models.loading.st_files import DenseSpec, SentenceTransformerFiles

logger = logging.getLogger(__name__)

TOKEN_EMBEDDINGS = "token_embeddings"
# Keys of config_sentence_transformers.json that sentence-transformers reads as a PyLate / Stanford ColBERT
# save: it then registers prefix tokens on the tokenizer and feeds lengths and expansion to the Transformer.
_LEGACY_KEYS = (
    "query_prefix",
    "document_prefix",
    "query_length",
    "document_length",
    "query_expansion",
    "do_query_expansion",
    "attend_to_expansion_tokens",
    "attend_to_mask_tokens",
    "skiplist_words",
)
_EXPANSION_KEYS = {"strategy", "attend", "token", "length"}


@dataclass(frozen=True)
class QueryExpansion:
    """Queries shorter than `length` tokens are padded to it with `token` (None: the tokenizer's mask token,
    else its EOS token). "fixed" also cuts longer queries to `length`; "min" leaves them to query_length."""

    strategy: str
    length: int
    token: str | None
    # True: the model attends to the expansion tokens like any other (the only kind served).
    attend: bool


@dataclass(frozen=True)
class MultiVectorSettings:
    # The token-level Dense layers in order (activations as the library reads them), and whether the
    # token vectors are L2-normalized after them.
    dense: tuple[DenseSpec, ...]
    normalize: bool
    # Token caps of the query and document tasks (None: the model's limit).
    query_length: int | None = None
    document_length: int | None = None
    expansion: QueryExpansion | None = None
    # MultiVectorMask: tokens dropped on the skiplist tasks (a call without a task counts as "document"),
    # and the only ids kept outside queries (None: all).
    skiplist_words: tuple[str, ...] = ()
    skiplist_tasks: tuple[str, ...] = ("document",)
    keep_only_token_ids: tuple[int, ...] | None = None
    # similarity_fn_name "meanmaxsim": MaxSim divided by the query's token count.
    mean_maxsim: bool = False


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def _length(config: dict, key: str, path: Path) -> int | None:
    value = config.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{path}: {key} must be a positive number of tokens or null, not {value!r}")
    return value


def _read_expansion(config: dict, path: Path) -> QueryExpansion | None:
    """query_expansion as Transformer validates it; attend false is refused (see below)."""
    value = config.get("query_expansion")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - _EXPANSION_KEYS or value.get("strategy") not in ("fixed", "min"):
        raise ConfigError(
            f"{path}: query_expansion must be a dict of strategy (fixed or min), attend, token and length, "
            f"not {value!r}"
        )
    length, attend, token = value.get("length"), value.get("attend", False), value.get("token")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1 or not isinstance(attend, bool):
        raise ConfigError(f"{path}: query_expansion needs a positive length and a true/false attend, not {value!r}")
    if not attend:
        # The expansion tokens would be hidden from attention (keys masked) while their own queries still
        # produce vectors; packed varlen attention runs whole sequences and cannot express that.
        raise ConfigError(
            f"{path}: query_expansion with attend false (ColBERT's [MASK] tokens that the model does not attend "
            "to, yet scores) is not served: embedserv's packed attention cannot hide tokens from the others while "
            "computing their vectors, so its query vectors would differ from sentence-transformers'. Models "
            "trained with attend true (PyLate's attend_to_expansion_tokens) are served"
        )
    if token is not None and not isinstance(token, str):
        raise ConfigError(f"{path}: query_expansion token must be a token string or null, not {token!r}")
    return QueryExpansion(value["strategy"], length, token, attend)


def _check_transformer(config: dict, path: Path) -> None:
    """The Transformer settings that change tokenization or outputs beyond what is read here."""
    task = config.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ConfigError(f"{path}: a MultiVectorEncoder Transformer with transformer_task {task!r} is not served")
    if config.get("processing_kwargs"):
        raise ConfigError(
            f"{path}: processing_kwargs {config['processing_kwargs']!r} change how sentence-transformers calls the "
            "tokenizer (padding, lengths, special tokens); such a model is not served"
        )
    modalities = config.get("modality_config")
    if modalities is not None and (
        set(modalities) != {"text"} or modalities["text"].get("method_output_name") != "last_hidden_state"
    ):
        raise ConfigError(
            f"{path}: modality_config {modalities!r} is not served (only text through the model's last hidden state)"
        )
    output = config.get("module_output_name", TOKEN_EMBEDDINGS) or TOKEN_EMBEDDINGS
    if output != TOKEN_EMBEDDINGS:
        raise ConfigError(
            f"{path}: the Transformer writes {output!r}; a MultiVectorEncoder's must write token_embeddings"
        )


def _dense(spec: DenseSpec, width: int) -> DenseSpec:
    """One Dense as the library loads it into a MultiVectorEncoder (a token-level layer)."""
    path = spec.directory / "config.json"
    config = _read_json(path)
    source = config.get("module_input_name") or TOKEN_EMBEDDINGS
    target = config.get("module_output_name") or source
    if (source, target) != (TOKEN_EMBEDDINGS, TOKEN_EMBEDDINGS):
        raise ConfigError(
            f"{path}: a MultiVectorEncoder's Dense must read and write token_embeddings, not {source!r} -> {target!r}"
        )
    if config.get("use_residual"):
        raise ConfigError(f"{path}: Dense with use_residual is not served")
    activation = config.get("activation_function")
    if activation is None:
        # Dense's constructor default.
        spec = replace(spec, activation="Tanh")
    elif not str(activation).startswith("torch."):
        raise ConfigError(
            f"{path}: Dense activation {activation} is not a torch class; sentence-transformers replaces it by "
            "Tanh unless trust_remote_code is set, so what it computes is ambiguous; not served"
        )
    if spec.in_features != width:
        raise ConfigError(f"{path}: the Dense layer takes {spec.in_features} features, but its input has {width}")
    return spec


def _normalize_dir(model_dir: Path) -> Path:
    modules = _read_json(model_dir / "modules.json")
    return next(model_dir / m.get("path", "") for m in modules if m["type"].rsplit(".", 1)[-1] == "Normalize")


def _normalizes_tokens(directory: Path) -> bool:
    """Normalize acts on token vectors only when it reads and writes token_embeddings; by default (and as
    older versions saved it, without a config) it reads sentence_embedding, which a MultiVectorEncoder
    never has, so the library skips it."""
    path = directory / "config.json"
    config = _read_json(path) if path.exists() else {}
    source = config.get("module_input_name") or "sentence_embedding"
    target = config.get("module_output_name") or source
    if (source, target) == (TOKEN_EMBEDDINGS, TOKEN_EMBEDDINGS):
        return True
    logger.warning(
        "%s: Normalize acts on %r -> %r, not the token vectors; like sentence-transformers, it is skipped",
        directory,
        source,
        target,
    )
    return False


def _read_mask(mask: dict, path: Path) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...] | None]:
    words, tasks, keep = mask.get("skiplist_words") or [], mask.get("skiplist_tasks"), mask.get("keep_only_token_ids")
    tasks = ["document"] if tasks is None else [tasks] if isinstance(tasks, str) else tasks
    if not all(isinstance(w, str) for w in words) or not all(isinstance(t, str) for t in tasks):
        raise ConfigError(f"{path}: skiplist_words and skiplist_tasks must be lists of strings")
    if keep is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in keep):
        raise ConfigError(f"{path}: keep_only_token_ids must be a list of token ids or null")
    # An empty allowlist keeps everything, as in the library.
    return tuple(words), tuple(tasks), tuple(keep) if keep else None


def read_multi_vector_settings(model_dir: Path, st: SentenceTransformerFiles, hidden_size: int) -> MultiVectorSettings:
    """A MultiVectorEncoder directory's settings (st_files has checked its module arrangement)."""
    st_path = model_dir / "config_sentence_transformers.json"
    st_config = _read_json(st_path) if st_path.exists() else {}
    legacy = [key for key in _LEGACY_KEYS if key in st_config]
    if legacy:
        raise ConfigError(
            f"{st_path}: {', '.join(legacy)} are PyLate-era settings that sentence-transformers converts on load "
            "(prefix tokens registered on the tokenizer, lengths, expansion); embedserv serves MultiVectorEncoder "
            "directories as sentence-transformers 6.2 saves them: load the model with MultiVectorEncoder and save it"
        )
    bert_path = model_dir / "sentence_bert_config.json"
    _check_transformer(st.transformer_config, bert_path)
    expansion = _read_expansion(st.transformer_config, bert_path)
    query_length = _length(st.transformer_config, "query_length", bert_path)
    if expansion is not None and query_length is not None and query_length < expansion.length:
        raise ConfigError(
            f"{bert_path}: query_length {query_length} is below query_expansion's length {expansion.length} "
            "(sentence-transformers refuses this model too)"
        )
    files = st.multi_vector
    dense, width = [], hidden_size
    for spec in files.dense:
        dense.append(_dense(spec, width))
        width = spec.out_features
    normalize = files.normalize and _normalizes_tokens(_normalize_dir(model_dir))
    words, tasks, keep = _read_mask(files.mask or {}, model_dir / "modules.json")
    similarity = st_config.get("similarity_fn_name")
    return MultiVectorSettings(
        dense=tuple(dense),
        normalize=normalize,
        query_length=query_length,
        document_length=_length(st.transformer_config, "document_length", bert_path),
        expansion=expansion,
        skiplist_words=words,
        skiplist_tasks=tasks,
        keep_only_token_ids=keep,
        # Saved names it does not support (cosine, dot from a converted model) fall back to maxsim there too.
        mean_maxsim=similarity == "meanmaxsim",
    )
