"""From a ModelConfig to the parts an Engine runs: tokenizer, model runner and what ListModels says."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from embedserv.attention.backends.base import AttentionBackend
from embedserv.attention.selector import AttentionSpec, select_backend
from embedserv.config import ModelConfig
from embedserv.engine.tasks import TaskSpec, architecture_of, read_task_spec
from embedserv.engine.tokenizer import TextTokenizer
from embedserv.engine.types import ModelInfo, Task
from embedserv.errors import ConfigError
from embedserv.models import registry
from embedserv.models.heads import Dense, EmbeddingPooler
from embedserv.models.layers import head_dim, num_kv_heads
from embedserv.models.lm_head import build_lm_head, has_lm_head
from embedserv.models.loader import build_model, checkpoint_files, load_dense_weights, read_hf_config
from embedserv.models.score_head import DECODER_CLASSIFIERS, YesNoTokens, build_classifier_head, build_yes_no_head
from embedserv.models.st_files import SentenceTransformerFiles, read_sentence_transformers
from embedserv.worker.generation_runner import GenerationModelRunner
from embedserv.worker.kv_cache import KvCacheSpec, allocate_kv_caches, num_kv_blocks
from embedserv.worker.model_runner import PrefillModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Pooling for a plain Hugging Face directory, as sentence-transformers chooses for one.
DEFAULT_POOLING = "mean"
# Tokenizers without a real limit report a huge model_max_length.
_NO_LIMIT = 1_000_000
# Prompt length of the generation warm-up (one prefill, then a few decode steps).
_GENERATION_WARM_UP_TOKENS = 64


@dataclass(frozen=True)
class ModelSpec:
    """A model without its weights: what the engine needs, and what a worker builds its replica from.

    Cheap to read (config, tokenizer, file headers), so the server process and every worker read their own.
    """

    info: ModelInfo
    tokenizer: TextTokenizer
    task: TaskSpec
    # Tokens that end a generation unless ignore_eos (generation_config.json, else config.json).
    eos_token_ids: frozenset[int]
    # Prompt plus generated tokens may not pass this (the model's positions).
    max_model_len: int
    model_dir: Path
    hf_config: object
    model_class: type
    st: SentenceTransformerFiles
    files: list[Path]
    backend: AttentionBackend
    device: torch.device
    dtype: torch.dtype


@dataclass
class Replica:
    """One copy of the model on one device, what a worker runs: a runner per path, and the KV cache size."""

    # None for a model that only generates.
    prefill: PrefillModelRunner | None
    # None for a model that does not generate.
    generation: GenerationModelRunner | None
    num_kv_blocks: int = 0

    def warm_up(self, max_input_tokens: int, max_batch_tokens: int) -> None:
        if self.prefill is not None:
            self.prefill.warm_up(max_input_tokens, max_batch_tokens)
        if self.generation is not None:
            self.generation.warm_up(_GENERATION_WARM_UP_TOKENS)


@dataclass
class LoadedModel:
    """A spec and its replica in this process (the in-process engine, tests)."""

    spec: ModelSpec
    replica: Replica


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
        load_dense_weights(layer, spec.directory, config.allow_pickle)
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


def read_model_spec(config: ModelConfig) -> ModelSpec:
    model_dir = Path(config.path).expanduser()
    if not (model_dir / "config.json").exists():
        raise ConfigError(f"--model {config.path}: no config.json there; give a local Hugging Face model directory")
    hf_config = read_hf_config(model_dir)
    entry = registry.lookup(hf_config.model_type)
    st = read_sentence_transformers(model_dir)
    device = _device(config.device)
    dtype = _DTYPES[config.torch_dtype_name]
    is_causal = registry.is_causal(hf_config, entry, config.attention)
    backend = select_backend(config.attention_backend, _attention_spec(hf_config, device, dtype, is_causal))
    files = checkpoint_files(model_dir, config.allow_pickle)
    task = read_task_spec(model_dir, hf_config, is_causal, config.decoder_reranker, has_lm_head(hf_config, files))
    max_positions = _max_positions(entry.model_class, hf_config, model_dir)
    max_tokens = _max_input_tokens(model_dir, st, max_positions)
    tokenizer = TextTokenizer(
        model_dir,
        max_tokens,
        do_lower_case=st.do_lower_case,
        prompts=st.prompts,
        default_prompt_name=st.default_prompt_name,
        include_prompt=st.include_prompt,
    )
    pooling, dimension = "", 0
    if Task.EMBED in task.tasks:
        pooling = config.pooling or st.pooling or DEFAULT_POOLING
        dimension = st.dense[-1].out_features if st.dense else hf_config.hidden_size
    elif task.tasks != (Task.GENERATE,):
        reads_last = task.template is not None or architecture_of(hf_config) in DECODER_CLASSIFIERS
        pooling = "lasttoken" if reads_last else "cls"
    info = ModelInfo(
        name=config.served_name,
        tasks=task.tasks,
        architecture=architecture_of(hf_config) or entry.model_class.__name__,
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
    eos = eos_token_ids(model_dir, hf_config, tokenizer) if Task.GENERATE in task.tasks else frozenset()
    return ModelSpec(
        info=info, tokenizer=tokenizer, task=task, eos_token_ids=eos, max_model_len=max_positions,
        model_dir=model_dir, hf_config=hf_config, model_class=entry.model_class, st=st, files=files,
        backend=backend, device=device, dtype=dtype,
    )


def _max_positions(model_class: type, hf_config, model_dir: Path) -> int:
    """The model's position limit, read off a weightless (meta) instance; also refuses configs it cannot run."""
    try:
        with torch.device("meta"):
            return model_class(hf_config).max_positions
    except ValueError as exc:
        raise ConfigError(f"{model_dir}: {exc}") from exc


def build_replica(config: ModelConfig, spec: ModelSpec) -> Replica:
    """Loads the weights onto spec.device and builds the runners (and the KV cache of a generating model)."""
    model = build_model(spec.model_class, spec.hf_config, spec.files, spec.device, spec.dtype)
    is_causal = spec.info.is_causal
    prefill = None
    if Task.EMBED in spec.task.tasks:
        head = _embedding_pooler(config, spec.st, spec.device, spec.dtype)
        prefill = PrefillModelRunner(model, head, spec.backend, spec.device, is_causal)
    elif spec.task.tasks != (Task.GENERATE,):
        head = _head(spec.task, spec.hf_config, spec.files, spec.tokenizer, spec.model_dir).to(spec.device)
        prefill = PrefillModelRunner(model, head, spec.backend, spec.device, is_causal)
    replica = Replica(prefill=prefill, generation=None)
    if Task.GENERATE in spec.task.tasks:
        replica.generation, replica.num_kv_blocks = _generation_runner(config, spec, model)
        logger.info(
            "%s: KV cache of %d blocks x %d tokens on %s, %d tokens per request at most",
            spec.info.name, replica.num_kv_blocks, config.kv_block_size, spec.device, spec.max_model_len,
        )
    return replica


def load_model(config: ModelConfig) -> LoadedModel:
    """The spec and a replica in this process."""
    spec = read_model_spec(config)
    log_spec(spec, config)
    return LoadedModel(spec=spec, replica=build_replica(config, spec))


def eos_token_ids(model_dir: Path, hf_config, tokenizer: TextTokenizer) -> frozenset[int]:
    """What transformers' generate stops at: generation_config.json's eos_token_id (an id or a list), else
    config.json's, else the tokenizer's EOS token."""
    value = None
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    if value is None:
        value = tokenizer.eos_token_id
    if value is None:
        return frozenset()
    return frozenset(value if isinstance(value, list) else [value])


def _generation_runner(config: ModelConfig, spec: ModelSpec, model) -> tuple[GenerationModelRunner, int]:
    lm_head = build_lm_head(spec.hf_config, spec.files, spec.device, spec.dtype)
    kv_spec = KvCacheSpec(
        num_layers=spec.hf_config.num_hidden_layers,
        num_kv_heads=num_kv_heads(spec.hf_config),
        head_size=head_dim(spec.hf_config),
        dtype=spec.dtype,
        block_size=config.kv_block_size,
    )
    num_blocks = num_kv_blocks(config.kv_cache_memory_or_default, kv_spec, spec.device)
    caches = allocate_kv_caches(kv_spec, num_blocks, spec.device)
    runner = GenerationModelRunner(model, lm_head, spec.backend, spec.device, caches, kv_spec.block_size)
    return runner, num_blocks


def log_spec(spec: ModelSpec, config: ModelConfig) -> None:
    info, task = spec.info, spec.task
    what = ", ".join(t.value for t in info.tasks)
    if task.template is not None:
        what += " (yes/no reranker" + (", from --decoder-reranker)" if config.decoder_reranker else ", from its path)")
    elif task.labels:
        what += f" ({len(task.labels)} labels{', multi-label' if task.multi_label else ''})"
    logger.info(
        "model %s at %s: %s for %s, %s attention (%s) via %s, %s pooling, dim %d, max %d tokens, %s on %s",
        info.name, spec.model_dir, info.architecture, what, "causal" if info.is_causal else "bidirectional",
        "from --attention" if config.attention else "from the model config", info.attention_backend,
        info.pooling, info.dimension, info.max_input_tokens, info.dtype, info.device,
    )
