"""The LM head of a generating model: hidden states -> vocabulary logits, for the rows that sample.

Causal LMs: `lm_head.weight`, or the embeddings when tied. Encoder-decoders follow transformers 5, which
ties the head to the token embeddings unless the checkpoint holds a head of its own, so `lm_head.weight`
when the files have it, else the shared embeddings; on top of that
- T5 v1.0 scales the decoder output by d_model**-0.5 before a head tied by its config (its model's
  `output_scale`): folded into the weight here, so the head stays one matmul;
- BART and mBART add `final_logits_bias` ([1, vocab], zeros when the checkpoint lacks it).
Gemma 3 and 4 cap the logits softly, `cap * tanh(logits / cap)` (`final_logit_softcapping`): the head
does it, so the sampler reads the capped logits as transformers' generate does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.layers import Linear
from embedserv.models.loading.checkpoint import has_tensor, read_first_tensor, read_tensor
from embedserv.models.loading.family import Family


def has_lm_head(family: Family, hf_config, files: list[Path]) -> bool:
    """A checkpoint can generate when its head is the embedding matrix (tied) or is saved beside it."""
    return family.is_encoder_decoder or is_tied(hf_config) or has_tensor(files, "lm_head.weight")


def is_tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", True))


def seq2seq_head_weight(family: Family, hf_config, files: list[Path], rows: slice | None = None) -> torch.Tensor:
    """An encoder-decoder's LM head matrix (or some of its rows) in float32, T5's output scale folded in."""
    names = ("lm_head.weight", *family.embeddings)
    weight = read_first_tensor(files, names, rows).float()
    if weight.shape[-1] != hf_config.d_model:
        raise ConfigError(
            f"{files[0].parent}: the LM head has shape {tuple(weight.shape)}, not [vocab, {hf_config.d_model}]"
        )
    scale = family.model_class.output_scale(hf_config)
    return weight * scale if scale != 1.0 else weight


def seq2seq_final_logits_bias(family: Family, hf_config, files: list[Path]) -> torch.Tensor | None:
    """BART's and mBART's [vocab] float32 logits bias (zeros when the checkpoint lacks it); None for T5."""
    names = family.model_class.final_logits_bias
    if not names:
        return None
    for name in names:
        bias = read_tensor(files, name)
        if bias is not None:
            return bias.reshape(-1).float()
    # transformers starts it at zeros and lets checkpoints leave it out.
    return torch.zeros(hf_config.vocab_size)


def _seq2seq_lm_head(family: Family, hf_config, files: list[Path]) -> Linear:
    weight = seq2seq_head_weight(family, hf_config, files)
    bias = seq2seq_final_logits_bias(family, hf_config, files)
    if bias is not None and bias.shape[0] != weight.shape[0]:
        raise ConfigError(
            f"{files[0].parent}: final_logits_bias has {bias.shape[0]} entries, the vocabulary {weight.shape[0]}"
        )
    head = Linear(hf_config.d_model, weight.shape[0], bias=bias is not None)
    head.weight.data = weight
    if bias is not None:
        head.bias.data = bias
    return head


def logit_softcap(hf_config) -> float | None:
    """Gemma's final logit softcapping cap, None for models without one."""
    cap = getattr(hf_config, "final_logit_softcapping", None)
    return float(cap) if cap else None


class SoftcappedLMHead(nn.Module):
    """`cap * tanh(head(hidden) / cap)` in float32, transformers' op order; [rows, vocab] float32."""

    def __init__(self, head: Linear, cap: float) -> None:
        super().__init__()
        self.head = head
        self.cap = cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(hidden).float() / self.cap) * self.cap


def build_lm_head(family: Family, hf_config, files: list[Path], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """[hidden] -> [vocab]: a Linear of `lm_head.weight`, or of the embeddings when tied (plus what the
    encoder-decoder families add, and Gemma's softcapping: see the module docstring)."""
    if family.is_encoder_decoder:
        head = _seq2seq_lm_head(family, hf_config, files)
    else:
        names = family.embeddings if is_tied(hf_config) else ("lm_head.weight",)
        weight = read_first_tensor(files, names)
        if weight.shape[1] != hf_config.hidden_size:
            raise ConfigError(
                f"{files[0].parent}: {names[0]} has shape {tuple(weight.shape)}, not [vocab, {hf_config.hidden_size}]"
            )
        head = Linear(hf_config.hidden_size, weight.shape[0], bias=False)
        head.weight.data = weight
    head.to(device=device, dtype=dtype)
    head.pack()
    cap = logit_softcap(hf_config)
    if cap is not None:
        head = SoftcappedLMHead(head, cap)
    return head.eval().requires_grad_(False)
