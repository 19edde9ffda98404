"""read_model_spec: what a served model is (its ModelSpec, loading/model_spec.py), read without its weights or
tokenizer and checked; the server process and every worker read it.

config.json through transformers' AutoConfig (no remote code), the family in models/registry.py,
the sentence-transformers files, causality (config, then --attention), the attention backend for the
model's shapes on its device, the task (tasks.py), the position limit (off a weightless instance) and the
input limit. ModelInfo is what ListModels reports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from embedserv.attention.backends.base import AttentionBackend
from embedserv.attention.layer import attention_layers
from embedserv.attention.selector import AttentionSpec, select_backend
from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.models import registry
from embedserv.models.heads.lm import has_lm_head
from embedserv.models.layers import head_dim, num_kv_heads
from embedserv.models.loading.checkpoint import checkpoint_files
from embedserv.models.loading.family import Family
from embedserv.models.loading.hf_config import read_hf_config
from embedserv.models.loading.lora_files import read_lora_adapters
from embedserv.models.loading.meta import meta_model
from embedserv.models.loading.model_spec import ModelSpec
from embedserv.models.loading.outputs import TOKEN_CLASSIFIER, OutputSpec, read_output_spec
from embedserv.models.loading.st_files import SentenceTransformerFiles, model_root, read_sentence_transformers
from embedserv.models.loading.tasks import TaskSpec, architecture_of, read_task_spec, with_outputs
from embedserv.types import EmbedOutput, Modality, ModelInfo, Task

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Pooling for a plain Hugging Face directory, as sentence-transformers chooses for one.
DEFAULT_POOLING = "mean"
# Tokenizers without a real limit report a huge model_max_length.
_NO_LIMIT = 1_000_000


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


# Model types whose activations overflow float16.
_FLOAT32_FEED_FORWARD_TYPES = ("t5", "mt5")


def _attention_config(hf_config, family: Family):
    """The config whose heads the backend must run: a dual encoder's text tower, whose head size its vision
    tower must share (every published CLIP and SigLIP has 64 in both); a vision-language model's language model
    (its vision tower's heads differ; every backend but flash_attn's head-size limits takes them)."""
    if family.vision is None:
        return family.text_config(hf_config)
    text, vision = hf_config.text_config, hf_config.vision_config
    if head_dim(vision) != head_dim(text):
        raise ConfigError(f"towers with different head sizes ({head_dim(text)}, {head_dim(vision)}) are not served")
    return text


def _attention_spec(
    hf_config, device: torch.device, dtype: torch.dtype, is_causal: bool, layout, generates: bool
) -> AttentionSpec:
    return AttentionSpec(
        device=device,
        dtype=dtype,
        head_size=head_dim(hf_config),
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=num_kv_heads(hf_config),
        is_causal=is_causal,
        relative_bias=layout.relative_bias,
        sliding_window=layout.sliding_window,
        disentangled=layout.disentangled,
        generates=generates,
    )


def _check_dtype(hf_config, dtype: torch.dtype, model_dir: Path) -> None:
    # transformers keeps T5's feed-forward output in float32 and clamps infinities in float16; we do
    # neither, and T5 v1.1 / Flan-T5 activations overflow float16's range.
    if dtype == torch.float16 and hf_config.model_type in _FLOAT32_FEED_FORWARD_TYPES:
        raise ConfigError(
            f"{model_dir}: T5 models overflow float16 (their activations pass its range); "
            "use --dtype bfloat16 or float32"
        )


def _check_quantization(config: ModelConfig, task: TaskSpec, family: Family, model_dir: Path) -> None:
    if config.quantization is None:
        return
    if Task.GENERATE in task.tasks:
        raise ConfigError(
            f"{model_dir}: --quantization int8 serves embedders, rerankers and classifiers; this model generates "
            "text, whose token-by-token sampling it was not validated for. Serve it without --quantization"
        )
    if family.takes_images:
        raise ConfigError(
            f"{model_dir}: --quantization int8 was not validated for text-image dual encoders (CLIP, SigLIP) or "
            "page-image retrievers (ColQwen2, ColPali, ColModernVBERT); serve this model without it"
        )
    if not torch.backends.mkldnn.is_available():
        raise ConfigError("--quantization int8 needs torch built with oneDNN (mkldnn), which this torch lacks")


def _lora_adapters(config: ModelConfig, task: TaskSpec, family: Family, hf_config, model_dir: Path):
    """The --lora adapters, read and checked (loading/lora_files.py); refused for models they cannot apply to."""
    if not config.lora:
        return ()
    names = ", ".join(name for name, _ in config.lora)
    if Task.GENERATE in task.tasks:
        raise ConfigError(
            f"{model_dir}: --lora ({names}) serves adapters for embedders, cross-encoders and classifiers; this "
            "model generates text. Serve it without --lora"
        )
    if getattr(hf_config, "lora_adaptations", None):
        raise ConfigError(
            f"{model_dir}: --lora ({names}): this model has built-in task adapters (pick one with the request's "
            "task); PEFT adapters are not served over them"
        )
    if not family.lora:
        covered = ", ".join(f.name for f in registry.FAMILIES if f.lora)
        raise ConfigError(
            f"{model_dir}: --lora ({names}) is served for the {covered} families; this model "
            f"({architecture_of(hf_config) or hf_config.model_type}, family {family.name}) is not among them"
        )
    return read_lora_adapters(config.lora)


@dataclass(frozen=True)
class _Layout:
    """What a weightless (meta) instance of the model says about its attention layers."""

    max_positions: int
    sliding_window: bool
    # At least one layer adds a relative position bias (T5, MPNet).
    relative_bias: bool
    # At least one layer adds DeBERTa's disentangled position bias.
    disentangled: bool
    # (layer, the layer whose KV it reads) for every layer that shares another's KV cache.
    kv_shared_layers: tuple[tuple[int, int], ...]
    # The model's first layer after its last KV writer (None: no layer shares KV).
    prefill_skip_layer: int | None


def _layout(model_class: type, hf_config, model_dir: Path) -> _Layout:
    """Reads the model's layout off a meta instance; also refuses configs it cannot run."""
    try:
        with meta_model():
            model = model_class(hf_config)
    except ValueError as exc:
        raise ConfigError(f"{model_dir}: {exc}") from exc
    layers = attention_layers(model)
    return _Layout(
        max_positions=model.max_positions,
        sliding_window=any(layer.sliding_window is not None for layer in layers),
        relative_bias=any(layer.relative_bias is not None for layer in layers),
        disentangled=any(layer.disentangled is not None for layer in layers),
        kv_shared_layers=tuple(
            (layer.layer_index, layer.kv_source_layer) for layer in layers if layer.kv_source_layer is not None
        ),
        prefill_skip_layer=model.prefill_skip_layer,
    )


def _check_fast_prefill(config: ModelConfig, layout: _Layout, family: Family) -> None:
    if not config.kv_sharing_fast_prefill:
        return
    if layout.prefill_skip_layer is None or family.is_encoder_decoder:
        raise ConfigError(
            f"--kv-sharing-fast-prefill: {config.path} has no layers that reuse an earlier layer's KV cache "
            "(Gemma 3n / Gemma 4 with num_kv_shared_layers do); leave the flag off for this model"
        )


def _pooling_and_dimension(
    config: ModelConfig, task: TaskSpec, st: SentenceTransformerFiles, hf_config, family: Family
):
    if family.vision is not None:
        tower = family.vision(hf_config)
        return tower.pooling, tower.dimension
    if task.tasks and task.tasks[0] in (Task.EMBED_SPARSE, Task.EMBED_MULTI_VECTOR):
        return ("splade" if task.tasks[0] is Task.EMBED_SPARSE else "", 0)
    if Task.EMBED in task.tasks:
        dimension = st.dense[-1].out_features if st.dense else family.text_config(hf_config).hidden_size
        return embedding_pooling(config, st, family), dimension
    if task.tasks not in ((Task.GENERATE,), (Task.TOKEN_CLASSIFY,)):
        reads_last = (
            task.template is not None
            or task.prefill_decoder_input is not None
            or (not family.is_encoder_decoder and _classifier_token(family, hf_config) == "last")
        )
        return "lasttoken" if reads_last else "cls", 0
    return "", 0


def embedding_pooling(config: ModelConfig, st: SentenceTransformerFiles, family: Family) -> str:
    """An embedder's pooling: --pooling, else its sentence-transformers Pooling, else its family's default."""
    return config.pooling or st.pooling or family.pooling or DEFAULT_POOLING


def _classifier_token(family: Family, hf_config) -> str | None:
    classifier = family.classifiers.get(architecture_of(hf_config))
    return classifier.token_for(hf_config) if classifier is not None else None


def _modalities(family: Family) -> tuple[Modality, ...]:
    return (Modality.TEXT, Modality.IMAGE) if family.takes_images else (Modality.TEXT,)


def takes_images(config: ModelConfig) -> bool:
    """Whether the model takes images, from its config.json alone (the server sizes its receive limit before any
    model loads); False where that cannot be read: loading the model then says why."""
    try:
        model_dir = model_root(Path(config.path).expanduser())
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type", "")
        return Modality.IMAGE in _modalities(registry.lookup(str(model_type)))
    except (OSError, ValueError, ConfigError):
        return False


def _output_spec(
    config: ModelConfig, model_dir: Path, hf_config, st: SentenceTransformerFiles, family: Family, task: TaskSpec
) -> OutputSpec:
    """What Embed can return and how (models/loading/outputs.py); a dual encoder one vector per input, in the
    joint space (model.pool)."""
    if Task.TOKEN_CLASSIFY in task.tasks:
        return OutputSpec((), head_kind=TOKEN_CLASSIFIER)
    outputs = read_output_spec(
        model_dir, hf_config, st, config.pooling, architecture_of(hf_config), embeds=Task.EMBED in task.tasks
    )
    if family.vision is None:
        return outputs
    if st.pooling or st.dense:
        raise ConfigError(f"{model_dir}: Pooling and Dense modules over a {family.name} model are not served")
    return OutputSpec((EmbedOutput.DENSE,), head_kind="hidden")


def read_model_spec(config: ModelConfig) -> ModelSpec:
    model_dir = model_root(Path(config.path).expanduser())
    if not (model_dir / "config.json").exists():
        raise ConfigError(f"--model {config.path}: no config.json there; give a local Hugging Face model directory")
    hf_config = read_hf_config(model_dir)
    family = registry.lookup(
        hf_config.model_type, architecture_of(hf_config), sentence_transformers=(model_dir / "modules.json").exists()
    )
    st = read_sentence_transformers(model_dir, family.model_class.st_transformer_modules)
    device = _device(config.device)
    dtype = _DTYPES[config.torch_dtype_name]
    _check_dtype(hf_config, dtype, model_dir)
    is_causal = registry.is_causal(family.text_config(hf_config), family, config.attention)
    layout = _layout(family.model_class, hf_config, model_dir)
    _check_fast_prefill(config, layout, family)
    files = checkpoint_files(model_dir, config.allow_pickle)
    task = read_task_spec(
        model_dir, hf_config, family, is_causal, config.decoder_reranker, has_lm_head(family, hf_config, files)
    )
    generates = Task.GENERATE in task.tasks
    attention = _attention_spec(_attention_config(hf_config, family), device, dtype, is_causal, layout, generates)
    backend = select_backend(config.attention_backend, attention)
    outputs = _output_spec(config, model_dir, hf_config, st, family, task)
    task = with_outputs(task, outputs.tasks)
    _check_quantization(config, task, family, model_dir)
    pooling, dimension = _pooling_and_dimension(config, task, st, hf_config, family)
    lora = _lora_adapters(config, task, family, hf_config, model_dir)
    info = ModelInfo(
        name=config.served_name,
        tasks=task.tasks,
        architecture=architecture_of(hf_config) or family.model_class.__name__,
        is_causal=is_causal,
        pooling=pooling,
        dimension=dimension,
        max_input_tokens=_max_input_tokens(model_dir, st, layout.max_positions),
        prompt_names=tuple(sorted(st.prompts)),
        dtype=config.quantization or config.torch_dtype_name,
        device=str(device),
        attention_backend=backend.name,
        labels=task.labels,
        is_encoder_decoder=family.is_encoder_decoder,
        kv_shared_layers=layout.kv_shared_layers,
        kv_sharing_fast_prefill=config.kv_sharing_fast_prefill,
        outputs=outputs.outputs,
        sparse_dimension=outputs.sparse_dimension,
        multi_vector_dimension=outputs.multi_vector_dimension,
        task_adapters=tuple(getattr(hf_config, "lora_adaptations", None) or ()),
        lora_adapters=tuple(adapter.name for adapter in lora),
        auto_truncate=config.auto_truncate,
        input_type_prompts=_input_type_prompts(config, st.prompts),
        modalities=_modalities(family),
    )
    return ModelSpec(
        info=info,
        task=task,
        max_model_len=layout.max_positions,
        model_dir=model_dir,
        hf_config=hf_config,
        family=family,
        st=st,
        files=files,
        backend=backend,
        device=device,
        dtype=dtype,
        kv_block_size=_kv_block_size(config, backend, task, device),
        outputs=outputs,
        lora=lora,
    )


def _input_type_prompts(config: ModelConfig, prompts: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """--input-type-prompt's pairs, refused at start-up where the model lacks the prompt: else every Cohere call
    of that input type would be refused."""
    for input_type, prompt in config.input_types:
        if prompt not in prompts:
            raise ConfigError(
                f"model {config.served_name} ({config.path}): input type {input_type} is mapped to the prompt "
                f"{prompt!r} (--input-type-prompt, input_types), which the model does not have; its prompts: "
                f"{', '.join(sorted(prompts)) or 'none (config_sentence_transformers.json has no prompts)'}"
            )
    return tuple((str(input_type), str(prompt)) for input_type, prompt in config.input_types)


def _kv_block_size(config: ModelConfig, backend: AttentionBackend, task: TaskSpec, device: torch.device) -> int:
    """--kv-block-size, else what the backend's paged kernel wants; one it cannot read stops start-up."""
    block_size = config.kv_block_size or backend.default_block_size
    if Task.GENERATE in task.tasks:
        try:
            backend.check_block_size(block_size, device)
        except ValueError as exc:
            raise ConfigError(
                f"--kv-block-size {block_size}: {exc}; leave it unset for the backend's default"
            ) from None
    return block_size
