"""config.json through transformers' AutoConfig. Code a model directory ships (config.json's auto_map) is
never imported."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import CONFIG_MAPPING, AutoConfig

from embedserv.errors import ConfigError
from embedserv.models import registry

logger = logging.getLogger(__name__)


def read_hf_config(model_dir: Path):
    """config.json through transformers' AutoConfig, never importing code the directory ships."""
    if not (model_dir / "config.json").exists() and (model_dir / "adapter_config.json").exists():
        _refuse_adapter(model_dir)
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {model_dir / 'config.json'}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{model_dir / 'config.json'} holds no JSON object")
    custom = raw.get("auto_map")
    native = registry.native_config(raw)
    if native is not None:
        return _from_native_dict(model_dir, raw, native)
    try:
        hf_config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except ValueError as exc:
        if not custom:
            raise ConfigError(f"{model_dir}/config.json: {exc}") from exc
        try:
            registry.lookup(str(raw.get("model_type")))
        except ConfigError as unsupported:
            raise ConfigError(
                f"{model_dir}: {unsupported}. Its config.json points at custom code (auto_map), which embedserv "
                "never runs"
            ) from None
        raise ConfigError(f"{model_dir}/config.json: {exc}") from exc
    if custom:
        # Such a config also names a transformers type; we run our own implementation of that type. A model
        # whose custom code differs from it fails to load (unexpected tensors) or must be checked by its user.
        logger.warning(
            "%s: config.json names custom code (auto_map: %s); embedserv never runs it and serves the model as "
            "model type %r with its own implementation",
            model_dir,
            ", ".join(sorted(custom)),
            hf_config.model_type,
        )
    return hf_config


def _from_native_dict(model_dir: Path, raw: dict, native: dict):
    """A published custom-code config, converted by its family (config_forms), as the native config."""
    native = dict(native)
    model_type = native.pop("model_type")
    try:
        hf_config = CONFIG_MAPPING[model_type](**native)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{model_dir}/config.json (read as {model_type}): {exc}") from exc
    logger.info(
        "%s: config.json in its published form (model_type %r%s) read as transformers' %r; its code never runs",
        model_dir,
        raw.get("model_type"),
        ", auto_map" if raw.get("auto_map") else "",
        model_type,
    )
    return hf_config


def _refuse_adapter(model_dir: Path) -> None:
    """A PEFT adapter directory given as the model (colpali-engine publishes its retrievers so: vidore/colqwen2.5-v0.2
    over vidore/colqwen2.5-base): says what to serve instead."""
    try:
        base = json.loads((model_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    raise ConfigError(
        f"{model_dir} is a PEFT adapter (adapter_config.json, no config.json)"
        + (f" over {base}" if base else "")
        + ": merge it into its base model (peft's merge_and_unload, then save_pretrained with the base's processor "
        "files) and serve the merged directory, or serve it with --lora over a base model that takes LoRA"
    )
