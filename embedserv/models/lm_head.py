"""The LM head of a causal LM: hidden states -> vocabulary logits, for the rows that sample."""

from __future__ import annotations

from pathlib import Path

import torch

from embedserv.errors import ConfigError
from embedserv.models.layers import Linear
from embedserv.models.loader import has_tensor
from embedserv.models.score_head import read_first_tensor

_EMBEDDINGS = ("model.embed_tokens.weight", "embed_tokens.weight")


def has_lm_head(hf_config, files: list[Path]) -> bool:
    """A checkpoint can generate when its head is the embedding matrix (tied) or is saved beside it."""
    return is_tied(hf_config) or has_tensor(files, "lm_head.weight")


def is_tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", True))


def build_lm_head(hf_config, files: list[Path], device: torch.device, dtype: torch.dtype) -> Linear:
    """A bias-free Linear [hidden] -> [vocab] holding `lm_head.weight`, or the embeddings when tied."""
    names = _EMBEDDINGS if is_tied(hf_config) else ("lm_head.weight",)
    weight = read_first_tensor(files, names)
    if weight.shape[1] != hf_config.hidden_size:
        raise ConfigError(f"{files[0].parent}: {names[0]} has shape {tuple(weight.shape)}, not [vocab, {hf_config.hidden_size}]")
    head = Linear(hf_config.hidden_size, weight.shape[0], bias=False)
    head.weight.data = weight.to(device=device, dtype=dtype)
    head.pack()
    return head.eval().requires_grad_(False)
