"""Builds what a worker runs from a ModelSpec: the weights on the device, the heads, the KV cache, the runner."""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer

from embedserv import cpu_isa
from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.models import int8, registry
from embedserv.models.heads.adapter_heads import AdapterScoreHeads, adapter_head
from embedserv.models.heads.lm import build_lm_head, is_tied, logit_softcap
from embedserv.models.heads.pooling import Dense, EmbeddingPooler
from embedserv.models.heads.score import (
    ScoreHead,
    YesNoTokens,
    build_classifier_head,
    build_seq2seq_yes_no_head,
    build_yes_no_head,
)
from embedserv.models.layers import quantize_linears
from embedserv.models.loading.lora_files import attach_lora
from embedserv.models.loading.model_spec import ModelSpec
from embedserv.models.loading.spec_reader import embedding_pooling
from embedserv.models.loading.tasks import Seq2SeqYesNoTemplate, architecture_of
from embedserv.models.loading.weights import build_model, load_dense_weights
from embedserv.types import Task
from embedserv.worker.kv_cache import KvCache, allocate_kv_caches, kv_cache_groups, num_kv_blocks
from embedserv.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _embedding_pooler(config: ModelConfig, spec: ModelSpec) -> EmbeddingPooler:
    dense = []
    for dense_spec in spec.st.dense:
        layer = Dense(dense_spec)
        load_dense_weights(layer, dense_spec.directory, config.allow_pickle)
        dense.append(layer.to(device=spec.device, dtype=spec.dtype))
    return EmbeddingPooler(embedding_pooling(config, spec.st, spec.family), dense).eval().requires_grad_(False)


def _token_ids(spec: ModelSpec, yes: str, no: str) -> tuple[int, int]:
    # The one head that needs the tokenizer: a yes/no reranker reads the rows of its yes and no tokens.
    backend = AutoTokenizer.from_pretrained(str(spec.model_dir), trust_remote_code=False).backend_tokenizer
    yes_id, no_id = backend.token_to_id(yes), backend.token_to_id(no)
    if yes_id is None or no_id is None:
        raise ConfigError(
            f"{spec.model_dir}: a yes/no reranker needs {yes!r} and {no!r} tokens; its tokenizer lacks them"
        )
    return yes_id, no_id


def _yes_no_tokens(spec: ModelSpec) -> YesNoTokens:
    yes_id, no_id = _token_ids(spec, "yes", "no")
    return YesNoTokens(yes_id=yes_id, no_id=no_id)


def _ties_embeddings(spec: ModelSpec) -> bool:
    """Whether the LM head is the token embeddings: config.json's tie_word_embeddings (true when absent), or a
    vision-language model's text_config saying so (Qwen3-VL-2B's; its checkpoint then holds no lm_head)."""
    text = spec.family.text_config(spec.hf_config)
    return is_tied(spec.hf_config) or (text is not spec.hf_config and bool(getattr(text, "tie_word_embeddings", False)))


def _row_head(config: ModelConfig, spec: ModelSpec):
    """The pooler of an embedder, the score head of a classifier or yes/no reranker, or None."""
    tasks = spec.task.tasks
    if spec.family.vision is not None:
        # Dual encoders pool through the model's own heads (model.pool).
        return None
    if Task.EMBED in tasks:
        return _embedding_pooler(config, spec)
    if spec.outputs.outputs:
        # Sparse-only and multi-vector-only models have no pooled vector: their heads are the sparse and token heads.
        return None
    if tasks in ((Task.GENERATE,), (Task.TOKEN_CLASSIFY,)):
        # Token classifiers classify in their token head.
        return None
    if isinstance(spec.task.template, Seq2SeqYesNoTemplate):
        template = spec.task.template
        yes_id, no_id = _token_ids(spec, template.yes_token, template.no_token)
        head = build_seq2seq_yes_no_head(spec.family, spec.hf_config, spec.files, yes_id, no_id)
    elif spec.task.template is not None:
        hidden = spec.family.text_config(spec.hf_config).hidden_size
        tokens = _yes_no_tokens(spec)
        softcap = logit_softcap(spec.hf_config)
        head = build_yes_no_head(spec.family, hidden, tokens, _ties_embeddings(spec), spec.files, softcap)
    else:
        head = build_classifier_head(spec.family, spec.hf_config, len(spec.task.labels), spec.files)
    return head.to(spec.device)


def _with_adapter_heads(head, spec: ModelSpec, tensors: dict[int, dict]):
    """The row head, with --lora adapters' own classifier heads (modules_to_save) where they save one."""
    if not tensors:
        return head
    classifier = spec.family.classifiers.get(architecture_of(spec.hf_config))
    if type(head) is not ScoreHead or classifier is None:
        names = ", ".join(spec.lora[index].name for index in tensors)
        raise ConfigError(
            f"--lora {names}: saves a classifier head (modules_to_save), but {spec.info.name} is no "
            "*ForSequenceClassification model; train the adapter without modules_to_save"
        )
    heads = {i: adapter_head(head, classifier, t, spec.lora[i].name).to(spec.device) for i, t in tensors.items()}
    return AdapterScoreHeads(head, heads)


def _kv_cache(config: ModelConfig, spec: ModelSpec, model) -> KvCache:
    groups = kv_cache_groups(model, spec.kv_block_size, spec.dtype)
    num_blocks = num_kv_blocks(config.kv_cache_memory_or_default, groups, spec.device)
    tensors = allocate_kv_caches(model, groups, num_blocks, spec.backend, spec.device)
    logger.info(
        "%s: KV cache of %d blocks x %d tokens in %d group(s) on %s, %d tokens per request at most",
        spec.info.name,
        num_blocks,
        spec.kv_block_size,
        len(groups),
        spec.device,
        spec.max_model_len,
    )
    return KvCache(tensors=tensors, groups=groups, num_blocks=num_blocks)


def build_runner(config: ModelConfig, spec: ModelSpec) -> ModelRunner:
    """Loads the weights onto spec.device; the runner with its heads (and the KV cache of a generating model)."""
    if config.quantization == "int8":
        # Quantized from the float32 weights; what stays float (norms, embeddings) is then cast to dtype.
        model = build_model(spec.family, spec.hf_config, spec.files, spec.device, torch.float32)
        quantize_linears(model, *cpu_isa.int8_levels())
        model.to(spec.dtype)
        fused, why = cpu_isa.fusion(config.cpu_fusion)
        int8.configure(fused == "compiled")
        logger.info(
            "%s: int8 linears, activations in %s; quantize and dequantize steps %s (%s)",
            spec.info.name,
            spec.dtype,
            fused,
            why,
        )
    else:
        model = build_model(spec.family, spec.hf_config, spec.files, spec.device, spec.dtype)
    adapter_heads = {}
    if spec.lora:
        # After int8: the adapters' updates stay in dtype, added to the int8 linears' outputs.
        wrapped, adapter_heads = attach_lora(model, spec.family, spec.lora, spec.dtype)
        logger.info(
            "%s: %d LoRA adapter(s) over %d linears, %d with a head of their own",
            spec.info.name,
            len(spec.lora),
            wrapped,
            len(adapter_heads),
        )
    lm_head = kv_cache = None
    if Task.GENERATE in spec.task.tasks:
        lm_head = build_lm_head(spec.family, spec.hf_config, spec.files, spec.device, spec.dtype)
        kv_cache = _kv_cache(config, spec, model)
    # The heads that make sparse and token vectors (SPLADE, a MultiVectorEncoder's, bge-m3's), if any.
    heads = registry.head_kind(spec.outputs.head_kind)
    return ModelRunner(
        model,
        spec.backend,
        spec.device,
        spec.info.is_causal,
        row_head=_with_adapter_heads(_row_head(config, spec), spec, adapter_heads),
        lm_head=lm_head,
        kv_cache=kv_cache,
        kv_sharing_fast_prefill=config.kv_sharing_fast_prefill,
        rows_read_last=spec.info.pooling == "lasttoken",
        sparse_head=heads.sparse_head(spec, config.allow_pickle) if heads.sparse_head else None,
        token_head=heads.token_head(spec, config.allow_pickle) if heads.token_head else None,
    )
