"""ELECTRA discriminators (cross-encoder/ms-marco-electra-base, ELECTRA embedders) over a flat packed batch.

The discriminator is BERT (bert.py's embeddings and layer) with one difference: its embeddings may be
narrower than its layers (`embedding_size` < `hidden_size`, in the small models), and then a linear
`embeddings_project` widens them before the first layer. Positions count from 0, as BERT's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from embedserv.models.families.bert import CHECKPOINT as BERT_CHECKPOINT
from embedserv.models.families.bert import ROBERTA_CLASSIFIER, BertEmbeddings, BertLayer
from embedserv.models.interface import EncoderModel
from embedserv.models.layers import Linear
from embedserv.models.loading.family import TOKEN_CLASSIFIER, CheckpointNames, Family, FamilyDocs


class ElectraModel(nn.Module, EncoderModel):
    """`forward(input_ids, positions[, token_type_ids]) -> [num_tokens, hidden]`."""

    reads_token_types = True

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported")
        self.config = config
        self.embeddings = BertEmbeddings(config, config.embedding_size)
        # transformers makes the projection only when the widths differ.
        self.embeddings_project = (
            Linear(config.embedding_size, config.hidden_size) if config.embedding_size != config.hidden_size else None
        )
        self.layers = nn.ModuleList(BertLayer(config, i) for i in range(config.num_hidden_layers))

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions, token_type_ids=None) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        if self.embeddings_project is not None:
            hidden = self.embeddings_project(hidden)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


# ElectraModel / ElectraFor* names (under `electra.`), or bare (sentence-transformers): BERT's layer names.
CHECKPOINT = CheckpointNames(
    prefixes=("electra.",),
    # The pretraining and task heads (models/heads read the ones they serve), and buffers.
    ignored=r"^(generator_predictions\.|generator_lm_head\.|discriminator_predictions\.|classifier\.|qa_outputs\."
    r"|embeddings\.(position_ids|token_type_ids))",
    packed=BERT_CHECKPOINT.packed,
    renames=BERT_CHECKPOINT.renames,
)

# ElectraClassificationHead: RoBERTa's head (classifier.dense, classifier.out_proj on the first token), with
# gelu instead of tanh.
_CLASSIFIER = replace(ROBERTA_CLASSIFIER, activation="gelu")

FAMILY = Family(
    name="electra",
    model_types=("electra",),
    model_class=ElectraModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    classifiers={"ElectraForSequenceClassification": _CLASSIFIER},
    token_classifiers={"ElectraForTokenClassification": TOKEN_CLASSIFIER},
)

DOCS = FamilyDocs(
    examples=(
        "cross-encoder/ms-marco-electra-base",
        "google/electra-small-discriminator",
    ),
    tested_by=("tests/models/test_electra_parity.py", "tests/models/test_token_classify_parity.py"),
)
