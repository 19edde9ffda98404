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
from embedserv.engine.tokenizer import TextTokenizer
from embedserv.engine.types import ModelInfo, Task
from embedserv.errors import ConfigError
from embedserv.models import registry
from embedserv.models.heads import Dense, EmbeddingPooler
from embedserv.models.layers import head_dim, num_kv_heads
from embedserv.models.loader import build_model, load_dense_weights, safetensors_files
from embedserv.models.st_files import SentenceTransformerFiles, read_sentence_transformers
from embedserv.worker.model_runner import EmbeddingModelRunner

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
    runner: EmbeddingModelRunner


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
    backend = select_backend(config.attention_backend, _attention_spec(hf_config, device, dtype, is_causal))

    model = build_model(entry.model_class, hf_config, safetensors_files(model_dir), device, dtype)
    dense = []
    for spec in st.dense:
        layer = Dense(spec)
        load_dense_weights(layer, spec.directory)
        dense.append(layer.to(device=device, dtype=dtype))
    pooling = config.pooling or st.pooling or DEFAULT_POOLING
    pooler = EmbeddingPooler(pooling, dense).eval().requires_grad_(False)
    runner = EmbeddingModelRunner(model, pooler, backend, device, is_causal)

    max_tokens = _max_input_tokens(model_dir, st, model.max_positions)
    tokenizer = TextTokenizer(
        model_dir,
        max_tokens,
        do_lower_case=st.do_lower_case,
        prompts=st.prompts,
        default_prompt_name=st.default_prompt_name,
        include_prompt=st.include_prompt,
    )
    info = ModelInfo(
        name=config.served_name,
        tasks=(Task.EMBED,),
        architecture=(hf_config.architectures or [type(model).__name__])[0],
        is_causal=is_causal,
        pooling=pooling,
        dimension=st.dense[-1].out_features if st.dense else hf_config.hidden_size,
        max_input_tokens=max_tokens,
        prompt_names=tuple(sorted(st.prompts)),
        dtype=config.torch_dtype_name,
        device=str(device),
        attention_backend=backend.name,
    )
    logger.info(
        "loaded %s from %s: %s, %s attention (%s) via %s, %s pooling, dim %d, max %d tokens, %s on %s",
        info.name, model_dir, info.architecture, "causal" if is_causal else "bidirectional",
        "from --attention" if config.attention else "from the model config", backend.name,
        pooling, info.dimension, max_tokens, info.dtype, info.device,
    )
    return LoadedModel(info=info, tokenizer=tokenizer, runner=runner)
