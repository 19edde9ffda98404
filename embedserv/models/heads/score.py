"""Score heads: per-sequence logits for rerank and classify, from one token's hidden state.

One head for every checkpoint layout:
- *ForSequenceClassification heads read the first or the last token, through dense + tanh or not, then a
  linear layer, as their family's Classifier record says (BERT and RoBERTa: the first token with a pooler;
  Llama family: the last, a bias-free `score`; BART: the decoder's last, with a pooler).
- Yes/no rerankers (Qwen3-Reranker) are causal LMs read at the last token as logit(yes) - logit(no).
  That difference is h . w_yes - h . w_no = h . (w_yes - w_no), so the head is a one-row linear layer
  holding the difference of two LM-head rows, not a vocabulary-sized matmul. Seq2seq yes/no rerankers
  (monoT5: logit("▁true") - logit("▁false")) are the same at their first and only decoder token.

The head runs in float32 on the few selected rows whatever the model's dtype, as sentence-transformers
upcasts scores before its activation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.heads.pooling import PoolingInputs
from embedserv.models.heads.lm import seq2seq_final_logits_bias, seq2seq_head_weight
from embedserv.models.loading.checkpoint import read_first_tensor
from embedserv.models.loading.family import Family


@dataclass(frozen=True)
class YesNoTokens:
    yes_id: int
    no_id: int


class ScoreHead(nn.Module):
    """`forward(hidden, pooling) -> [num_seqs, num_labels]` float32 logits."""

    def __init__(self, hidden_size: int, num_labels: int, token: str, pooler: bool, bias: bool) -> None:
        super().__init__()
        if token not in ("first", "last"):
            raise ValueError(f"token must be first or last, not {token!r}")
        self.token = token
        self.dense = nn.Linear(hidden_size, hidden_size) if pooler else None
        self.out = nn.Linear(hidden_size, num_labels, bias=bias)

    def forward(self, hidden: torch.Tensor, pooling: PoolingInputs) -> torch.Tensor:
        index = pooling.first_index if self.token == "first" else pooling.last_index
        rows = hidden.index_select(0, index).float()
        if self.dense is not None:
            rows = torch.tanh(self.dense(rows))
        return self.out(rows)


def build_classifier_head(
    family: Family, architecture: str, hidden_size: int, num_labels: int, files: list[Path]
) -> ScoreHead:
    """The head of a *ForSequenceClassification checkpoint (its family's Classifier), filled from its files."""
    classifier = family.classifiers.get(architecture)
    if classifier is None:
        supported = ", ".join(family.classifiers) or "none"
        raise ConfigError(f"architecture {architecture} has no score head; supported for {family.name}: {supported}")
    head = ScoreHead(hidden_size, num_labels, token=classifier.token, pooler=classifier.pooler, bias=classifier.pooler)
    params = dict(head.named_parameters())
    for ours, names in classifier.sources.items():
        tensor = read_first_tensor(files, names)
        if tensor.shape != params[ours].shape:
            raise ConfigError(
                f"checkpoint {files[0].parent}: {names[0]} has shape {tuple(tensor.shape)}, "
                f"the config says {tuple(params[ours].shape)} (num_labels {num_labels})"
            )
        params[ours].data.copy_(tensor)
    return head.eval().requires_grad_(False)


class SoftcappedYesNoHead(ScoreHead):
    """logit(yes) - logit(no) of an LM head with final logit softcapping (Gemma): each logit is capped,
    cap * tanh(logit / cap), before the difference, so the head keeps both rows."""

    def __init__(self, hidden_size: int, cap: float) -> None:
        super().__init__(hidden_size, 2, token="last", pooler=False, bias=False)
        self.cap = cap

    def forward(self, hidden: torch.Tensor, pooling: PoolingInputs) -> torch.Tensor:
        logits = torch.tanh(super().forward(hidden, pooling) / self.cap) * self.cap
        return logits[:, :1] - logits[:, 1:]


def build_yes_no_head(
    family: Family, hidden_size: int, tokens: YesNoTokens, tied: bool, files: list[Path],
    softcap: float | None = None,
) -> ScoreHead:
    """logit(yes) - logit(no) at the last token, from the LM head's rows (the embeddings when tied); one row,
    their difference, unless the logits are softcapped."""
    names = family.embeddings if tied else ("lm_head.weight",)
    yes = read_first_tensor(files, names, slice(tokens.yes_id, tokens.yes_id + 1)).float()
    no = read_first_tensor(files, names, slice(tokens.no_id, tokens.no_id + 1)).float()
    if softcap is not None:
        head = SoftcappedYesNoHead(hidden_size, softcap)
        head.out.weight.data.copy_(torch.cat((yes, no)))
        return head.eval().requires_grad_(False)
    head = ScoreHead(hidden_size, 1, token="last", pooler=False, bias=False)
    head.out.weight.data.copy_(yes - no)
    return head.eval().requires_grad_(False)


def build_seq2seq_yes_no_head(family: Family, hf_config, files: list[Path], true_id: int, false_id: int) -> ScoreHead:
    """logit(true) - logit(false) of an encoder-decoder LM (monoT5) at the last (first and only) decoder
    token: the difference of the two LM-head rows, with T5's tied output scale folded in, plus the
    difference of BART's final_logits_bias entries where there is one."""
    true = seq2seq_head_weight(family, hf_config, files, slice(true_id, true_id + 1))
    false = seq2seq_head_weight(family, hf_config, files, slice(false_id, false_id + 1))
    bias = seq2seq_final_logits_bias(family, hf_config, files)
    head = ScoreHead(hf_config.d_model, 1, token="last", pooler=False, bias=bias is not None)
    head.out.weight.data.copy_(true - false)
    if bias is not None:
        head.out.bias.data.copy_((bias[true_id] - bias[false_id]).reshape(1))
    return head.eval().requires_grad_(False)
