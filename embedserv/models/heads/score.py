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
from embedserv.models.heads.lm import seq2seq_final_logits_bias, seq2seq_head_weight
from embedserv.models.heads.pooling import PoolingInputs, mean_per_sequence, pooled_rows
from embedserv.models.layers import get_activation
from embedserv.models.loading.checkpoint import read_first_tensor, read_tensor
from embedserv.models.loading.family import Classifier, Family
from embedserv.models.loading.tasks import architecture_of


@dataclass(frozen=True)
class YesNoTokens:
    yes_id: int
    no_id: int


class ScoreHead(nn.Module):
    """`forward(hidden, pooling) -> [num_seqs, num_labels]` float32 logits.

    token: "first", "last", "mean" (over each sequence's tokens), or "late" (the pooler on every token, then
    the mean), or "every" (TokenClassifierHead's, heads/token_classifier.py); pooler: a dense layer and
    `activation` (then a LayerNorm of `norm_eps` when given) before the output layer.
    """

    def __init__(
        self,
        hidden_size: int,
        num_labels: int,
        token: str,
        pooler: bool,
        bias: bool,
        activation: str = "tanh",
        norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        if token not in ("first", "last", "mean", "late", "every"):
            raise ValueError(f"token must be first, last, mean, late or every, not {token!r}")
        self.token = token
        self.dense = nn.Linear(hidden_size, hidden_size) if pooler else None
        self.activation = get_activation(activation) if pooler else None
        self.norm = nn.LayerNorm(hidden_size, eps=norm_eps) if pooler and norm_eps is not None else None
        self.out = nn.Linear(hidden_size, num_labels, bias=bias)

    def forward(self, hidden: torch.Tensor, pooling: PoolingInputs) -> torch.Tensor:
        if self.token == "late":
            # The pooler on every token, then the mean: the output layer is linear, so averaging before it
            # equals averaging its per-token logits (EuroBERT's "late" pooling).
            return self.out(mean_per_sequence(self._pooler(pooled_rows(hidden, pooling).float()), pooling))
        if self.token == "mean":
            rows = mean_per_sequence(pooled_rows(hidden, pooling), pooling)
        else:
            index = pooling.first_index if self.token == "first" else pooling.last_index
            rows = hidden.index_select(0, index).float()
        return self.out(self._pooler(rows))

    def _pooler(self, rows: torch.Tensor) -> torch.Tensor:
        if self.dense is None:
            return rows
        rows = self.activation(self.dense(rows))
        return rows if self.norm is None else self.norm(rows)


def build_classifier_head(family: Family, hf_config, num_labels: int, files: list[Path]) -> ScoreHead:
    """The head of a *ForSequenceClassification checkpoint (its family's Classifier), filled from its files."""
    architecture = architecture_of(hf_config)
    classifier = family.classifiers.get(architecture)
    if classifier is None:
        supported = ", ".join(family.classifiers) or "none"
        raise ConfigError(f"architecture {architecture} has no score head; supported for {family.name}: {supported}")
    head = ScoreHead(
        hf_config.hidden_size,
        num_labels,
        token=classifier.token_for(hf_config),
        pooler=classifier.pooler,
        bias=classifier.pooler or "out.bias" in classifier.sources,
        activation=classifier.activation_for(hf_config),
        norm_eps=head_norm_eps(classifier, hf_config),
    )
    load_head(head, classifier, files, num_labels)
    return head.eval().requires_grad_(False)


def head_norm_eps(classifier: Classifier, hf_config) -> float | None:
    """The epsilon of the LayerNorm after a classifier's pooler; None without one."""
    if not classifier.norm:
        return None
    return getattr(hf_config, "norm_eps", None) or getattr(hf_config, "layer_norm_eps", 1e-12)


def load_head(head: nn.Module, classifier: Classifier, files: list[Path], num_labels: int) -> None:
    """Fills `head`'s parameters from the checkpoint names its Classifier gives; optional ones it lacks stay zero."""
    for ours, param in head.named_parameters():
        names = classifier.sources.get(ours, ())
        if ours in classifier.optional and all(read_tensor(files, name) is None for name in names):
            param.data.zero_()
            continue
        tensor = read_first_tensor(files, names)
        if tensor.shape != param.shape:
            raise ConfigError(
                f"checkpoint {files[0].parent}: {names[0]} has shape {tuple(tensor.shape)}, "
                f"the config says {tuple(param.shape)} (num_labels {num_labels})"
            )
        param.data.copy_(tensor)


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
    family: Family,
    hidden_size: int,
    tokens: YesNoTokens,
    tied: bool,
    files: list[Path],
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
