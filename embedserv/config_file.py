"""`embedserv serve --config FILE`: server settings and per-model options from one YAML file, merged with
the flags into the ServerConfig.

    server:    ServerConfig fields but `models`, named as the flags with _ (port, max_concurrent_requests)
    defaults:  ModelConfig fields but path and served_name, applied to every model
    models:    a list; each entry takes `path`, an optional `served_name` and any ModelConfig field
               (`lora`: a mapping of adapter names to PEFT adapter directories, as --lora NAME=PATH;
               `input_types`: a mapping of Cohere input types to prompt names, as --input-type-prompt TYPE=PROMPT)

A model's options are, lowest first: the dataclass defaults, `defaults:`, the flags given on the command
line, its own entry. Server settings: the dataclass defaults, `server:`, the flags. Models come either from
the file or from --model, never both. This module only reads keys and checks types; values are checked by
the dataclasses' __post_init__, as for flags, and their messages are relabelled to name the file's key.
"""

from __future__ import annotations

import difflib
import functools
import re
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from embedserv.api_keys import api_keys_of
from embedserv.config import ModelConfig, ServerConfig, bundled_model_path
from embedserv.errors import ConfigError
from embedserv.sizes import parse_bytes, parse_memory

# The bundled model's directory is called `model`; serve it under its real name.
BUNDLED_MODEL_NAME = "all-MiniLM-L6-v2"
TOP_KEYS = ("server", "defaults", "models")
SERVER_KEYS = tuple(f.name for f in fields(ServerConfig) if f.name != "models")
MODEL_KEYS = tuple(f.name for f in fields(ModelConfig))
# Options that every model may share: all but what names one model.
MODEL_OPTION_KEYS = tuple(k for k in MODEL_KEYS if k not in ("path", "served_name"))
_HINTS = {**typing.get_type_hints(ModelConfig), **typing.get_type_hints(ServerConfig)}
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")
# Flags whose key is not their name with _ (a repeatable flag sets one pair of a mapping key).
_FLAG_KEYS = {"input_type_prompt": "input_types"}


@dataclass(frozen=True)
class ConfigFile:
    """The file's sections, keys known and values of the fields' types (not yet validated)."""

    path: str
    server: dict[str, object]
    defaults: dict[str, object]
    # Each entry has `path`; `served_name` only when the file names the model.
    models: tuple[dict[str, object], ...]


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        # `<<: *anchor` merges are allowed to be overridden by the mapping's own keys.
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_config_file(path: str) -> ConfigFile:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        document = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        detail = "; ".join(filter(None, (getattr(exc, "context", None), getattr(exc, "problem", None))))
        raise ConfigError(f"{where}: not valid YAML: {detail or exc}") from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: the top level must be a mapping with {', '.join(TOP_KEYS)}")
    _check_keys(document, TOP_KEYS, path)
    server = _section(document, "server", SERVER_KEYS, path)
    defaults = _section(document, "defaults", MODEL_OPTION_KEYS, path)
    models = document.get("models")
    if models is None:
        return ConfigFile(path, server, defaults, ())
    if not isinstance(models, list) or not models:
        raise ConfigError(
            f"{path}: models must be a list of models (each a mapping with a path); "
            "leave it out to serve the --model flags"
        )
    return ConfigFile(path, server, defaults, tuple(_model_entry(path, i, entry) for i, entry in enumerate(models)))


def _section(document: dict, name: str, valid: tuple[str, ...], path: str) -> dict[str, object]:
    section = document.get(name)
    if section is None:
        return {}
    where = f"{path}: {name}"
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a mapping of key: value, not {_kind(section)}")
    _check_keys(section, valid, where)
    return {key: _typed(value, key, where) for key, value in section.items()}


def _model_entry(path: str, index: int, entry: object) -> dict[str, object]:
    where = f"{path}: models[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a mapping with at least a path, not {_kind(entry)}")
    model_path = entry.get("path")
    if not isinstance(model_path, str) or not model_path:
        raise ConfigError(f"{where} needs a path: the model's local directory")
    where = f"{where} ({model_path})"
    _check_keys(entry, MODEL_KEYS, where)
    return {key: _typed(value, key, where) for key, value in entry.items()}


def _check_keys(mapping: dict, valid: tuple[str, ...], where: str) -> None:
    for key in mapping:
        if key in valid:
            continue
        name = str(key)
        if name in MODEL_OPTION_KEYS:
            hint = " (a model option: put it under defaults: for every model, or in a model's entry)"
        elif name in SERVER_KEYS:
            hint = " (a server setting: put it under server:)"
        elif name in ("path", "served_name"):
            hint = " (it names one model: put it in that model's entry under models:)"
        else:
            close = difflib.get_close_matches(name.replace("-", "_"), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}: unknown key {name!r}{hint}; valid keys: {', '.join(valid)}")


def _typed(value: object, key: str, where: str) -> object:
    """The value if its YAML type fits the field's type (an int for a float field becomes a float)."""
    if key == "kv_cache_memory" and isinstance(value, str):
        return _relabelled(lambda: parse_memory(value), {key: where})
    if key == "embedding_cache" and isinstance(value, str):
        return _relabelled(lambda: parse_bytes(value, "--embedding-cache"), {key: where})
    if key == "api_keys":
        return api_keys_of(value, where)
    if key == "lora":
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{where}: lora must map adapter names to their directories (NAME: PATH), not {value!r}")
        return tuple((str(name), path) for name, path in value.items())
    if key == "input_types":
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(
                f"{where}: input_types must map Cohere input types to the model's prompt names "
                f"(search_query: query), not {value!r}"
            )
        return tuple((str(input_type), prompt) for input_type, prompt in value.items())
    hint = _HINTS[key]
    allowed = typing.get_args(hint) or (hint,)
    if value is None and type(None) in allowed:
        return None
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if kind in (int, float) and isinstance(value, int) and not isinstance(value, bool):
            return kind(value)
        if (kind is float and isinstance(value, float)) or (kind is str and isinstance(value, str)):
            return value
    expected = " or ".join(_TYPE_NAMES[k] for k in allowed if k in _TYPE_NAMES)
    if key in ("kv_cache_memory", "embedding_cache"):
        expected += " or a size such as 2GiB"
    if type(None) in allowed:
        expected += " or null"
    quote = " (quote it to make it a string)" if str in allowed and value is not None else ""
    raise ConfigError(f"{where}: {key} must be {expected}, not {value!r} ({_kind(value)}){quote}")


def _kind(value: object) -> str:
    return {dict: "a mapping", list: "a list", type(None): "null"}.get(type(value), type(value).__name__)


def _relabelled(build: typing.Callable, places: dict[str, str], where_unflagged: str | None = None):
    """Runs build(). The dataclasses' messages name --flags: a flag whose value came from the file becomes
    its key, after where in the file it is (places: key -> where). A message that names no flag gets
    where_unflagged when given."""
    try:
        return build()
    except ConfigError as exc:
        text = str(exc)
        keys = [_key_of(m.group(1)) for m in _FLAG.finditer(text)]
        placed = [key for key in keys if key in places]
        if placed:
            text = _FLAG.sub(lambda m: _key_if(m, places), text)
            raise ConfigError(f"{places[placed[0]]}: {text}") from None
        if not keys and where_unflagged:
            raise ConfigError(f"{where_unflagged}: {text}") from None
        raise


def _key_of(flag: str) -> str:
    name = flag.replace("-", "_")
    return _FLAG_KEYS.get(name, name)


def _key_if(match: re.Match, places: dict[str, str]) -> str:
    key = _key_of(match.group(1))
    return key if key in places else match.group(0)


def served_names(paths: list[str], names: list[str] | None) -> list[str]:
    if names and len(names) != len(paths):
        raise ConfigError(f"{len(names)} --served-model-name for {len(paths)} --model; give one name per model or none")
    if names:
        return names
    return [default_served_name(p) for p in paths]


def default_served_name(path: str) -> str:
    """The model directory's name; the bundled model's real name for the bundled directory."""
    resolved = Path(path).resolve()
    return BUNDLED_MODEL_NAME if resolved == bundled_model_path().resolve() else resolved.name


def assemble(
    file: ConfigFile | None,
    model_flags: dict[str, object],
    server_flags: dict[str, object],
    paths: list[str] | None,
    names: list[str] | None,
) -> ServerConfig:
    """The ServerConfig from the file (may be None) and the flags given on the command line (only those)."""
    if file is None:
        file = ConfigFile("", {}, {}, ())
    defaults = file.defaults
    # Where a bad value came from when the file set it: the flags override defaults: and server:.
    from_defaults = {key: f"{file.path}: defaults" for key in defaults if key not in model_flags}
    from_server = {key: f"{file.path}: server" for key in file.server if key not in server_flags}
    if file.models:
        if paths or names:
            flag = "--model" if paths else "--served-model-name"
            raise ConfigError(
                f"{flag} cannot be combined with the models: of --config {file.path}; list every model "
                "(path, served_name) in the file, or drop models: from it and use --model"
            )
        models = []
        for i, entry in enumerate(file.models):
            where = f"{file.path}: models[{i}] ({entry['path']})"
            places = {**from_defaults, **{key: where for key in entry}}
            models.append(_relabelled(functools.partial(_model, entry, defaults, model_flags), places, where))
    else:
        paths = paths or [str(bundled_model_path())]
        models = [
            _relabelled(functools.partial(_model, {"path": p, "served_name": n}, defaults, model_flags), from_defaults)
            for p, n in zip(paths, served_names(paths, names), strict=True)
        ]
    settings: dict[str, Any] = {**file.server, **server_flags}
    return _relabelled(lambda: ServerConfig(models=tuple(models), **settings), from_server, file.path or None)


def _model(entry: dict[str, Any], defaults: dict[str, Any], flags: dict[str, Any]) -> ModelConfig:
    options = {**defaults, **flags, **entry}
    if "served_name" not in options:
        options["served_name"] = default_served_name(str(options["path"]))
    return ModelConfig(**options)
