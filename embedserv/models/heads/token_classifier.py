"""The head of a *ForTokenClassification checkpoint: its family's token Classifier (loading/family.py) on every
token's state, as the worker's token head (hidden rows -> per-token logits).

In float32 on the token rows whatever the model's dtype, as the score heads run (heads/score.py); dropout is
off at inference, so transformers' head is the output layer alone, after ModernBERT's prediction head (dense,
activation, LayerNorm) where it has one.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.heads.score import ScoreHead, head_norm_eps, load_head
from embedserv.models.loading.tasks import architecture_of


class TokenClassifierHead(ScoreHead):
    """`forward(rows) -> [rows, num_labels]` float32 logits, for [rows, hidden] token states."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.out(self._pooler(rows.float()))


def build_token_classifier_head(spec, allow_pickle: bool) -> nn.Module:
    """The token head of a token classifier's ModelSpec (models/registry.HEAD_KINDS), on its device."""
    hf_config, family = spec.hf_config, spec.family
    architecture = architecture_of(hf_config)
    classifier = family.token_classifiers.get(architecture)
    if classifier is None:
        supported = ", ".join(family.token_classifiers) or "none"
        raise ConfigError(f"{architecture} is no token classifier; supported for {family.name}: {supported}")
    num_labels = len(spec.task.labels)
    head = TokenClassifierHead(
        hf_config.hidden_size,
        num_labels,
        token="every",
        pooler=classifier.pooler,
        bias=classifier.pooler or "out.bias" in classifier.sources,
        activation=classifier.activation_for(hf_config),
        norm_eps=head_norm_eps(classifier, hf_config),
    )
    load_head(head, classifier, spec.files, num_labels)
    return head.eval().requires_grad_(False).to(spec.device)
