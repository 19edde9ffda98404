"""Score heads: per-sequence logits for rerank and classify, from one token's hidden state.

Four checkpoint layouts, one head:
- BERT-family ForSequenceClassification reads the first token through dense + tanh, then a linear
  layer (BERT names them `pooler.dense` + `classifier`, RoBERTa/XLM-R `classifier.dense` +
  `classifier.out_proj`: the same math).
- Llama-family ForSequenceClassification reads the last token through a bias-free linear `score`.
- BartForSequenceClassification reads the decoder's last token (transformers pools the decoder state at
  the input's last EOS; fed shift_tokens_right(input_ids), the decoder's last position holds that EOS's
  state when the input ends with it) through `classification_head.dense` + tanh + `out_proj`.
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
from embedserv.models.heads import PoolingInputs
from embedserv.models.lm_head import seq2seq_final_logits_bias, seq2seq_head_weight
from embedserv.models.loader import read_first_tensor

_BERT_CLASSIFIERS = ("BertForSequenceClassification",)
_ROBERTA_CLASSIFIERS = (
    "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification",
    "CamembertForSequenceClassification",
)
DECODER_CLASSIFIERS = (
    "LlamaForSequenceClassification",
    "MistralForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
)
# Encoder-decoder classifiers, read at the decoder's last token. (MBartForSequenceClassification has the
# same head but feeds its decoder mBART's own shift of the input, its last token first: not served yet.)
SEQ2SEQ_CLASSIFIERS = ("BartForSequenceClassification",)
SEQUENCE_CLASSIFIERS = _BERT_CLASSIFIERS + _ROBERTA_CLASSIFIERS + DECODER_CLASSIFIERS + SEQ2SEQ_CLASSIFIERS


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


def _classifier_sources(architecture: str) -> dict[str, tuple[str, ...]]:
    """Our head parameter -> checkpoint names to try, in order."""
    if architecture in _BERT_CLASSIFIERS:
        return {
            "dense.weight": ("bert.pooler.dense.weight", "pooler.dense.weight"),
            "dense.bias": ("bert.pooler.dense.bias", "pooler.dense.bias"),
            "out.weight": ("classifier.weight",),
            "out.bias": ("classifier.bias",),
        }
    if architecture in _ROBERTA_CLASSIFIERS:
        return {
            "dense.weight": ("classifier.dense.weight",),
            "dense.bias": ("classifier.dense.bias",),
            "out.weight": ("classifier.out_proj.weight",),
            "out.bias": ("classifier.out_proj.bias",),
        }
    if architecture in DECODER_CLASSIFIERS:
        return {"out.weight": ("score.weight",)}
    if architecture in SEQ2SEQ_CLASSIFIERS:
        return {
            f"{ours}.{kind}": (f"classification_head.{theirs}.{kind}", f"model.classification_head.{theirs}.{kind}")
            for ours, theirs in (("dense", "dense"), ("out", "out_proj"))
            for kind in ("weight", "bias")
        }
    raise ConfigError(f"architecture {architecture} has no score head; supported: {', '.join(SEQUENCE_CLASSIFIERS)}")


def build_classifier_head(architecture: str, hidden_size: int, num_labels: int, files: list[Path]) -> ScoreHead:
    """The head of a *ForSequenceClassification checkpoint, filled from its files."""
    pooler = architecture not in DECODER_CLASSIFIERS
    token = "first" if architecture not in DECODER_CLASSIFIERS + SEQ2SEQ_CLASSIFIERS else "last"
    head = ScoreHead(hidden_size, num_labels, token=token, pooler=pooler, bias=pooler)
    params = dict(head.named_parameters())
    for ours, names in _classifier_sources(architecture).items():
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
    hidden_size: int, tokens: YesNoTokens, tied: bool, files: list[Path], softcap: float | None = None
) -> ScoreHead:
    """logit(yes) - logit(no) at the last token, from the LM head's rows (the embeddings when tied); one row,
    their difference, unless the logits are softcapped."""
    names = ("model.embed_tokens.weight", "embed_tokens.weight") if tied else ("lm_head.weight",)
    yes = read_first_tensor(files, names, slice(tokens.yes_id, tokens.yes_id + 1)).float()
    no = read_first_tensor(files, names, slice(tokens.no_id, tokens.no_id + 1)).float()
    if softcap is not None:
        head = SoftcappedYesNoHead(hidden_size, softcap)
        head.out.weight.data.copy_(torch.cat((yes, no)))
        return head.eval().requires_grad_(False)
    head = ScoreHead(hidden_size, 1, token="last", pooler=False, bias=False)
    head.out.weight.data.copy_(yes - no)
    return head.eval().requires_grad_(False)


def build_seq2seq_yes_no_head(hf_config, files: list[Path], true_id: int, false_id: int) -> ScoreHead:
    """logit(true) - logit(false) of an encoder-decoder LM (monoT5) at the last (first and only) decoder
    token: the difference of the two LM-head rows, with T5's tied output scale folded in, plus the
    difference of BART's final_logits_bias entries where there is one."""
    true = seq2seq_head_weight(hf_config, files, slice(true_id, true_id + 1))
    false = seq2seq_head_weight(hf_config, files, slice(false_id, false_id + 1))
    bias = seq2seq_final_logits_bias(hf_config, files)
    head = ScoreHead(hf_config.d_model, 1, token="last", pooler=False, bias=bias is not None)
    head.out.weight.data.copy_(true - false)
    if bias is not None:
        head.out.bias.data.copy_((bias[true_id] - bias[false_id]).reshape(1))
    return head.eval().requires_grad_(False)
