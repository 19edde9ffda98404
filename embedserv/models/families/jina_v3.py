"""jina-embeddings-v3: XLM-RoBERTa with rotary positions and one LoRA adapter per task, over a flat packed batch.

Post-norm blocks as in BERT (attention -> add -> LayerNorm -> MLP -> add -> LayerNorm), but positions are
rotary (no position embeddings) and every linear and embedding carries low-rank updates, one per task
(`lora_adaptations`: retrieval.query, retrieval.passage, separation, classification, text-matching). A
token of task t computes `W x + scaling * B_t (A_t x)`, scaling = lora_alpha / lora_rank: the published code
merges `W + scaling * B_t A_t` into the weight, which is the same product. A token without a task uses the
base weights, as the published `encode(task=None)` and transformers' class (which has no adapters) do.

The step's tokens may belong to different tasks: `adapter_ids` gives each token's adapter index (-1: none),
and each linear adds its low-rank updates in two thin matmuls over every row, the present tasks' A's and
B's stacked and a mask keeping each row's own task (models/lora.py, shared with --lora adapters). Measured
on 2 shared cores, a 1024 -> 3072 linear over 2048 rows (30-40 ms): the updates add 2.2 ms with one task,
2.6 ms with three. Merging a weight per task instead costs 1.6 ms per linear and step, serves one task per
step, and loses the oneDNN-packed weight (F.linear on the merged weight: 63 ms).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from embedserv.attention.layer import Attention
from embedserv.models.families.bert import ROBERTA_CLASSIFIER
from embedserv.models.interface import EncoderModel
from embedserv.models.layers import Linear, get_activation, packed_linear
from embedserv.models.loading.family import QKV, CheckpointNames, Family, FamilyDocs
from embedserv.models.lora import LowRank, LowRankEmbedding, Routes, routes_of
from embedserv.models.rotary import RotaryEmbedding, apply_rotary


def published_config(raw: dict) -> dict | None:
    """jinaai/jina-embeddings-v3's config.json (model_type xlm-roberta, custom code with rotary positions and
    LoRA adapters) as transformers' jina_embeddings_v3 config; None for a plain XLM-RoBERTa config."""
    if raw.get("position_embedding_type") != "rotary":
        return None
    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "max_position_embeddings",
        "type_vocab_size",
        "layer_norm_eps",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "lora_adaptations",
        "task_instructions",
        "lora_rank",
        "lora_alpha",
    )
    native = {key: raw[key] for key in keys if key in raw}
    # The published code's default base when the config names none (its XLMRobertaFlashConfig).
    native["rope_parameters"] = {"rope_type": "default", "rope_theta": float(raw.get("rotary_emb_base", 10000.0))}
    native["architectures"] = ["JinaEmbeddingsV3Model"]
    native["model_type"] = "jina_embeddings_v3"
    return native


def _low_rank(config, in_features: int, out_features: int, cls=LowRank):
    """The linear's adapters, or None for a checkpoint without them (transformers' native form)."""
    tasks = getattr(config, "lora_adaptations", None)
    if not tasks:
        return None
    return cls(in_features, out_features, len(tasks), config.lora_rank, config.lora_alpha / config.lora_rank)


def _plus(lora, out: torch.Tensor, x: torch.Tensor, routes: Routes | None) -> torch.Tensor:
    return out if lora is None or routes is None else lora.add_to(out, x, routes)


class JinaEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.word_embeddings_lora = _low_rank(config, config.vocab_size, hidden, LowRankEmbedding)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.token_type_embeddings_lora = _low_rank(config, config.type_vocab_size, hidden, LowRankEmbedding)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, input_ids, token_type_ids, routes: Routes | None) -> torch.Tensor:
        hidden = _plus(self.word_embeddings_lora, self.word_embeddings(input_ids), input_ids, routes)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        types = self.token_type_embeddings(token_type_ids)
        types = _plus(self.token_type_embeddings_lora, types, token_type_ids, routes)
        return self.LayerNorm(hidden + types)


class JinaAttention(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        # Query, key and value in one matmul, as the published `Wqkv`; the loader stacks the native q/k/v.
        self.qkv = packed_linear(hidden, (hidden,) * 3)
        self.qkv_lora = _low_rank(config, hidden, 3 * hidden)
        self.attn = Attention(self.num_heads, self.head_dim, layer_index=layer_index)
        self.o_proj = Linear(hidden, hidden)
        self.o_proj_lora = _low_rank(config, hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, routes: Routes | None) -> torch.Tensor:
        """Attention of `x`, plus `x` (the residual, fused into the output projection)."""
        qkv = _plus(self.qkv_lora, self.qkv(x), x, routes)
        qk, v = qkv.split((2 * self.num_heads * self.head_dim, self.num_heads * self.head_dim), dim=-1)
        # Queries and keys sit side by side in the fused output: one rotation covers both.
        qk = apply_rotary(qk.view(-1, 2 * self.num_heads, self.head_dim), cos, sin)
        out = self.attn(qk[:, : self.num_heads].flatten(1), qk[:, self.num_heads :].flatten(1), v)
        return _plus(self.o_proj_lora, self.o_proj(out, residual=x), out, routes)


class JinaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        # The activation follows the adapters' update, so it is not fused into fc1.
        self.fc1 = Linear(hidden, inner)
        self.fc1_lora = _low_rank(config, hidden, inner)
        self.act = get_activation(config.hidden_act)
        self.fc2 = Linear(inner, hidden)
        self.fc2_lora = _low_rank(config, inner, hidden)

    def forward(self, x: torch.Tensor, routes: Routes | None) -> torch.Tensor:
        """fc2(act(fc1 x)), plus `x`."""
        inner = self.act(_plus(self.fc1_lora, self.fc1(x), x, routes))
        return _plus(self.fc2_lora, self.fc2(inner, residual=x), inner, routes)


class JinaLayer(nn.Module):
    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.self_attn = JinaAttention(config, layer_index)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = JinaMLP(config)
        self.post_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, routes: Routes | None
    ) -> torch.Tensor:
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin, routes))
        return self.post_mlp_layernorm(self.mlp(hidden, routes))


class JinaEmbeddingsV3Model(nn.Module, EncoderModel):
    """`forward(input_ids, positions[, token_type_ids][, adapter_ids]) -> [num_tokens, hidden]`."""

    reads_token_types = True
    has_task_adapters = True
    config_forms: ClassVar[dict] = {"xlm-roberta": published_config}
    st_transformer_modules = ("custom_st.Transformer",)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = JinaEmbeddings(config)
        self.layers = nn.ModuleList(JinaLayer(config, i) for i in range(config.num_hidden_layers))
        self.rotary = RotaryEmbedding(config, config.hidden_size // config.num_attention_heads, self.max_positions)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def forward(self, input_ids, positions, token_type_ids=None, adapter_ids=None) -> torch.Tensor:
        routes = routes_of(adapter_ids, self.embeddings.LayerNorm.weight.dtype)
        hidden = self.embeddings(input_ids, token_type_ids, routes)
        cos, sin = self.rotary(positions)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, routes)
        return hidden


# Native names (JinaEmbeddingsV3Model, bare or under `roberta.`), and the published checkpoint's:
# `roberta.encoder.layers.N.mixer.Wqkv.parametrizations.weight.original` (the base weight) and
# `...parametrizations.weight.0.lora_A` / `lora_B` (the adapters), `emb_ln`, `norm1`, `norm2`.
CHECKPOINT = CheckpointNames(
    prefixes=("roberta.",),
    # Pooler and task heads (models/heads read the ones they serve), and buffers.
    ignored=r"^(pooler\.|classifier\.|lm_head\.|embeddings\.(position_ids|token_type_ids)$)",
    packed=(*QKV,),
    renames=(
        (r"\.parametrizations\.weight\.original$", ".weight"),
        (r"\.parametrizations\.weight\.0\.(lora_[AB])$", r"_lora.\1"),
        (r"^emb_ln\.", "embeddings.LayerNorm."),
        (r"^encoder\.layers\.", "layers."),
        (r"\.mixer\.Wqkv", ".self_attn.qkv"),
        (r"\.mixer\.out_proj", ".self_attn.o_proj"),
        (r"\.norm1\.", ".post_attention_layernorm."),
        (r"\.norm2\.", ".post_mlp_layernorm."),
    ),
)

FAMILY = Family(
    name="jina_v3",
    model_types=("jina_embeddings_v3",),
    model_class=JinaEmbeddingsV3Model,
    checkpoint=CHECKPOINT,
    is_encoder=True,
    # XLM-RoBERTa's head: the first token through dense + tanh, then `out_proj`.
    classifiers={"JinaEmbeddingsV3ForSequenceClassification": ROBERTA_CLASSIFIER},
)

DOCS = FamilyDocs(
    examples=("jinaai/jina-embeddings-v3", "jinaai/jina-embeddings-v3-hf"),
    tested_by=("tests/models/test_jina_v3_parity.py",),
)
