"""From a ModelConfig to the parts an Engine runs: tokenizer, model runner and what ListModels says."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from embedserv.attention.selector import AttentionSpec, select_backend
from embedserv.config import ModelConfig
from embedserv.engine.tasks import TaskSpec, architecture_of, read_task_spec
from embedserv.engine.tokenizer import TextTokenizer
from embedserv.engine.types import ModelInfo, Task
from embedserv.errors import ConfigError
from embedserv.models import registry
from embedserv.models.heads import Dense, EmbeddingPooler
from embedserv.models.layers import head_dim, num_kv_heads
from embedserv.models.loader import build_model, load_dense_weights, safetensors_files
from embedserv.models.score_head import YesNoTokens, build_classifier_head, build_yes_no_head
from embedserv.models.st_files import SentenceTransformerFiles, read_sentence_transformers
from embedserv.worker.model_runner import PrefillModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Pooling for a plain Hugging Face directory, as sentence-transformers chooses for one.
DEFAULT_POOLING = "mean"
# Tokenizers without a real limit report a huge model_max_length.
_NO_LIMIT = 1_000_000


@dataclass
class LoadedModel:
    info: ModelInfo
    tokenizer: TextTokenizer
    runner: PrefillModelRunner
    task: TaskSpec


def _max_input_tokens(model_dir: Path, st: SentenceTransformerFiles, max_positions: int) -> int:
    """sentence_bert_config's max_seq_length, else the tokenizer's model_max_length, within the positions."""
    limit = st.max_seq_length
    if limit is None:
        tokenizer_config = model_dir / "tokenizer_config.json"
        if tokenizer_config.exists():
            value = json.loads(tokenizer_config.read_text()).get("model_max_length")
            if isinstance(value, (int, float)) and 0 < value < _NO_LIMIT:
                limit = int(value)
    return min(int(limit), max_positions) if limit else max_positions


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asked for CUDA, but torch sees no CUDA device")
    return device


def _attention_spec(hf_config, device: torch.device, dtype: torch.dtype, is_causal: bool) -> AttentionSpec:
    return AttentionSpec(
        device=device,
        dtype=dtype,
        head_size=head_dim(hf_config),
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=num_kv_heads(hf_config),
        is_causal=is_causal,
    )


def _embedding_pooler(config: ModelConfig, st: SentenceTransformerFiles, device, dtype) -> EmbeddingPooler:
    dense = []
    for spec in st.dense:
        layer = Dense(spec)
        load_dense_weights(layer, spec.directory)
        dense.append(layer.to(device=device, dtype=dtype))
    pooling = config.pooling or st.pooling or DEFAULT_POOLING
    return EmbeddingPooler(pooling, dense).eval().requires_grad_(False)


def _yes_no_tokens(tokenizer: TextTokenizer, model_dir: Path) -> YesNoTokens:
    yes_id, no_id = tokenizer.token_id("yes"), tokenizer.token_id("no")
    if yes_id is None or no_id is None:
        raise ConfigError(f"{model_dir}: a yes/no reranker needs 'yes' and 'no' tokens; its tokenizer lacks them")
    return YesNoTokens(yes_id=yes_id, no_id=no_id)


def _head(task: TaskSpec, hf_config, files: list[Path], tokenizer: TextTokenizer, model_dir: Path):
    """The score head of a classifier or yes/no reranker (float32; see score_head.py)."""
    if task.template is not None:
        tied = bool(getattr(hf_config, "tie_word_embeddings", True))
        return build_yes_no_head(hf_config.hidden_size, _yes_no_tokens(tokenizer, model_dir), tied, files)
    return build_classifier_head(architecture_of(hf_config), hf_config.hidden_size, len(task.labels), files)


def load_model(config: ModelConfig) -> LoadedModel:
    model_dir = Path(config.path).expanduser()
    if not (model_dir / "config.json").exists():
        raise ConfigError(f"--model {config.path}: no config.json there; give a local Hugging Face model directory")
    hf_config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    entry = registry.lookup(hf_config.model_type)
    st = read_sentence_transformers(model_dir)
    device = _device(config.device)
    dtype = _DTYPES[config.torch_dtype_name]
    is_causal = registry.is_causal(hf_config, entry, config.attention)
    task = read_task_spec(model_dir, hf_config, is_causal, config.decoder_reranker)
    backend = select_backend(config.attention_backend, _attention_spec(hf_config, device, dtype, is_causal))

    files = safetensors_files(model_dir)
    model = build_model(entry.model_class, hf_config, files, device, dtype)
    max_tokens = _max_input_tokens(model_dir, st, model.max_positions)
    tokenizer = TextTokenizer(
        model_dir,
        max_tokens,
        do_lower_case=st.do_lower_case,
        prompts=st.prompts,
        default_prompt_name=st.default_prompt_name,
        include_prompt=st.include_prompt,
    )
    if Task.EMBED in task.tasks:
        head = _embedding_pooler(config, st, device, dtype)
        pooling, dimension = head.mode, st.dense[-1].out_features if st.dense else hf_config.hidden_size
    else:
        head = _head(task, hf_config, files, tokenizer, model_dir).to(device)
        pooling, dimension = ("cls" if head.token == "first" else "lasttoken"), 0
    runner = PrefillModelRunner(model, head, backend, device, is_causal)
    info = ModelInfo(
        name=config.served_name,
        tasks=task.tasks,
        architecture=architecture_of(hf_config) or type(model).__name__,
        is_causal=is_causal,
        pooling=pooling,
        dimension=dimension,
        max_input_tokens=max_tokens,
        prompt_names=tuple(sorted(st.prompts)),
        dtype=config.torch_dtype_name,
        device=str(device),
        attention_backend=backend.name,
        labels=task.labels,
    )
    _log_loaded(info, model_dir, config, task)
    return LoadedModel(info=info, tokenizer=tokenizer, runner=runner, task=task)


def _log_loaded(info: ModelInfo, model_dir: Path, config: ModelConfig, task: TaskSpec) -> None:
    what = ", ".join(t.value for t in info.tasks)
    if task.template is not None:
        what += " (yes/no reranker" + (", from --decoder-reranker)" if config.decoder_reranker else ", from its path)")
    elif task.labels:
        what += f" ({len(task.labels)} labels{', multi-label' if task.multi_label else ''})"
    logger.info(
        "loaded %s from %s: %s for %s, %s attention (%s) via %s, %s pooling, dim %d, max %d tokens, %s on %s",
        info.name, model_dir, info.architecture, what, "causal" if info.is_causal else "bidirectional",
        "from --attention" if config.attention else "from the model config", info.attention_backend,
        info.pooling, info.dimension, info.max_input_tokens, info.dtype, info.device,
    )
