"""MPNet encoders (all-mpnet-base-v2 and the other MPNet models) over a flat packed batch.

MPNet is BERT's post-norm layer with two position signals: learned absolute positions, counted from
`padding_idx + 1` as RoBERTa's are (transformers fixes padding_idx at 1, whatever pad_token_id says), and a
relative position bias that the encoder computes once and every layer adds to its scaled scores. The
bias is T5's bidirectional bucketing (32 buckets, distances up to 128), so attention/relative_bias.py
serves it: every backend adds it after scaling by 1/sqrt(head size), as MPNetSelfAttention does.
There are no token types.
"""

from __future__ import annotations

import torch
from torch import nn

from embedserv.attention.relative_bias import RelativePositionBias
from embedserv.models.families.bert import ROBERTA_CLASSIFIER, BertLayer
from embedserv.models.interface import EncoderModel
from embedserv.models.loading.family import TOKEN_CLASSIFIER, CheckpointNames, Family, FamilyDocs

# MPNetEmbeddings' fixed padding index: positions start after it.
_PADDING_IDX = 1
# MPNetEncoder.compute_position_bias buckets with these whatever the config says.
_NUM_BUCKETS = 32
_MAX_DISTANCE = 128


class MPNetEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, positions) -> torch.Tensor:
        return self.norm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


class MPNetModel(nn.Module, EncoderModel):
    """`forward(input_ids, positions) -> [num_tokens, hidden]`: MPNet has no token types."""

    # Positions start after the padding index, as RoBERTa's.
    position_offset = _PADDING_IDX + 1

    def __init__(self, config) -> None:
        super().__init__()
        # The bias table has relative_attention_num_buckets rows, but transformers buckets into 32: another
        # size would index past the table or leave rows unused there.
        if config.relative_attention_num_buckets != _NUM_BUCKETS:
            raise ValueError(
                f"relative_attention_num_buckets {config.relative_attention_num_buckets} is not supported "
                f"(MPNet buckets relative positions into {_NUM_BUCKETS})"
            )
        self.config = config
        self.embeddings = MPNetEmbeddings(config)
        self.relative_bias = RelativePositionBias(
            _NUM_BUCKETS, _MAX_DISTANCE, config.num_attention_heads, bidirectional=True
        )
        self.layers = nn.ModuleList(
            BertLayer(config, i, relative_bias=self.relative_bias) for i in range(config.num_hidden_layers)
        )

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings - self.position_offset

    def forward(self, input_ids, positions) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


# MPNetModel / MPNetFor* names (under `mpnet.`), or bare (sentence-transformers).
CHECKPOINT = CheckpointNames(
    prefixes=("mpnet.",),
    # The pooler and the task heads (models/heads read the ones they serve), and a buffer.
    ignored=r"^(pooler\.|lm_head\.|classifier\.|embeddings\.position_ids)",
    packed=tuple(
        (f"attention.attn.{part}.", "attention.attn.qkv.", index) for index, part in enumerate(("q", "k", "v"))
    ),
    renames=(
        (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
        (r"^encoder\.relative_attention_bias\.", "relative_bias.relative_attention_bias."),
        (r"^encoder\.layer\.(\d+)\.attention\.attn\.qkv\.", r"layers.\1.qkv."),
        (r"^encoder\.layer\.(\d+)\.attention\.attn\.o\.", r"layers.\1.attn_out."),
        (r"^encoder\.layer\.(\d+)\.attention\.LayerNorm\.", r"layers.\1.attn_norm."),
        (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn_in."),
        (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn_out."),
        (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.ffn_norm."),
    ),
)

FAMILY = Family(
    name="mpnet",
    model_types=("mpnet",),
    model_class=MPNetModel,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    # MPNetClassificationHead is RoBERTa's: the first token through dense + tanh, then out_proj.
    classifiers={"MPNetForSequenceClassification": ROBERTA_CLASSIFIER},
    token_classifiers={"MPNetForTokenClassification": TOKEN_CLASSIFIER},
    lora=True,
)

DOCS = FamilyDocs(
    examples=(
        "sentence-transformers/all-mpnet-base-v2",
        "sentence-transformers/multi-qa-mpnet-base-dot-v1",
        "sentence-transformers/paraphrase-mpnet-base-v2",
    ),
    tested_by=(
        "tests/models/test_mpnet_parity.py",
        "tests/models/test_lora_parity.py",
        "tests/models/test_token_classify_parity.py",
    ),
)
