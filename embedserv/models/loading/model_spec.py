"""ModelSpec: a model without its weights, as the engine and every worker see it (loading/spec_reader.py reads it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from embedserv.attention.backends.base import AttentionBackend
from embedserv.models.loading.family import Family
from embedserv.models.loading.lora_files import LoraAdapter
from embedserv.models.loading.outputs import OutputSpec
from embedserv.models.loading.st_files import SentenceTransformerFiles
from embedserv.models.loading.tasks import TaskSpec
from embedserv.types import ModelInfo


@dataclass(frozen=True)
class ModelSpec:
    """A model without its weights: what the engine needs, and what a worker builds its replica from."""

    info: ModelInfo
    task: TaskSpec
    # Prompt plus generated tokens may not pass this (the model's positions).
    max_model_len: int
    model_dir: Path
    hf_config: object
    family: Family
    st: SentenceTransformerFiles
    files: list[Path]
    backend: AttentionBackend
    device: torch.device
    dtype: torch.dtype
    # Tokens per KV-cache block: --kv-block-size, else the backend's default (what its paged kernel wants).
    kv_block_size: int
    # What Embed can return and how (models/loading/outputs.py).
    outputs: OutputSpec = field(default_factory=lambda: OutputSpec(()))
    # --lora adapters, in order: a sequence's `adapter` indexes them (loading/lora_files.py).
    lora: tuple[LoraAdapter, ...] = ()
