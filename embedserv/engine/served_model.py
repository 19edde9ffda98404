"""The engine's side of a served model: its ModelSpec (models/loading/spec_reader.py) plus what turns its calls into
inputs (engine/inputs/: the tokenizer, its token rules and, for models that take images, how their images become
sequences) and its EOS ids. Read at start-up by the engine host and by every front-end process.

Workers build their replicas from the ModelSpec alone (worker/replica.py); only the engine tokenizes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from embedserv import cpu_isa
from embedserv.config import ModelConfig
from embedserv.engine.inputs import colmodernvbert_rules, vl_embed_rules
from embedserv.engine.inputs.images import ImageLimits, ImageProcessing, read_image_processing
from embedserv.engine.inputs.images.processing import processing_from_dict
from embedserv.engine.inputs.multi_vector_rules import MultiVectorRules
from embedserv.engine.inputs.token_rules import TokenRules, VisionSpec
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.engine.inputs.vision_retrieval_rules import (
    VISION_RETRIEVAL,
    VisionRetrievalRules,
    read_retrieval_prompts,
)
from embedserv.engine.inputs.vl_embed_rules import VlEmbedRules
from embedserv.engine.inputs.vl_rerank_rules import VlRerankRules
from embedserv.errors import ConfigError
from embedserv.models import registry
from embedserv.models.loading.model_spec import ModelSpec
from embedserv.models.loading.spec_reader import read_model_spec
from embedserv.models.loading.tasks import TaskSpec, VlYesNoTemplate
from embedserv.types import ModelInfo, Task

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    spec: ModelSpec
    tokenizer: TextTokenizer
    # What is model-specific about its inputs and token vectors (the rules of its head kind).
    token_rules: TokenRules
    # Tokens that end a generation unless ignore_eos (generation_config.json, else config.json).
    eos_token_ids: frozenset[int]
    # None: the model takes texts only.
    vision: VisionSpec | None = None

    @property
    def info(self) -> ModelInfo:
        return self.spec.info

    @property
    def task(self) -> TaskSpec:
        return self.spec.task

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len


def read_served_model(config: ModelConfig) -> ServedModel:
    spec = read_model_spec(config)
    st = spec.st
    tower = spec.family.vision(spec.hf_config) if spec.family.vision is not None else None
    tokenizer = TextTokenizer(
        spec.model_dir,
        spec.info.max_input_tokens,
        do_lower_case=st.do_lower_case,
        prompts=st.prompts,
        default_prompt_name=st.default_prompt_name,
        include_prompt=st.include_prompt,
        # What the processor pads with: the tokenizer's pad token, else the config's.
        pad_texts=tower is not None and tower.pads_texts,
        fallback_pad_id=tower.text_pad_id if tower is not None else 0,
    )
    eos = eos_token_ids(spec.model_dir, spec.hf_config, tokenizer) if Task.GENERATE in spec.task.tasks else frozenset()
    vision = read_vision_spec(config, spec)
    rules = token_rules(spec, tokenizer, vision)
    return ServedModel(spec=spec, tokenizer=tokenizer, token_rules=rules, eos_token_ids=eos, vision=vision)


def token_rules(spec: ModelSpec, tokenizer: TextTokenizer, vision: VisionSpec | None) -> TokenRules:
    """The rules of the model's head kind (models/registry.HEAD_KINDS), whose heads the worker runs; a
    vision-language yes/no reranker's, whose pairs hold images."""
    heads = registry.head_kind(spec.outputs.head_kind)
    if heads.token_settings is not None:
        return MultiVectorRules(tokenizer, heads.token_settings(spec), spec.max_model_len, str(spec.model_dir))
    if spec.outputs.head_kind == VISION_RETRIEVAL and spec.info.architecture == colmodernvbert_rules.ARCHITECTURE:
        return colmodernvbert_rules.read_colmodernvbert_rules(spec.model_dir, spec.hf_config, tokenizer, vision)
    if spec.outputs.head_kind == VISION_RETRIEVAL:
        prompts = read_retrieval_prompts(spec.model_dir, spec.info.architecture, spec.hf_config, tokenizer)
        return VisionRetrievalRules(tokenizer, prompts, vision)
    if isinstance(spec.task.template, VlYesNoTemplate):
        merge = int(spec.hf_config.vision_config.spatial_merge_size)
        return VlRerankRules(tokenizer, merge, vision, spec.task.template)
    if spec.family.name in vl_embed_rules.FAMILIES:
        merge = int(spec.hf_config.vision_config.spatial_merge_size)
        return VlEmbedRules(tokenizer, merge, vision, vl_embed_rules.FRAMINGS[spec.family.name])
    return TokenRules(skip_first=heads.skip_first_tokens, vision=vision)


def read_vision_spec(config: ModelConfig, spec: ModelSpec) -> VisionSpec | None:
    """A dual encoder's image side (its family's VisionTower), or a vision-language model's, with its image
    processor's settings; refuses at start-up a model that takes images without them (preprocessor_config.json,
    else processor_config.json's), or with settings we cannot follow."""
    if not spec.family.takes_images:
        return None
    tower = spec.family.vision(spec.hf_config) if spec.family.vision is not None else None
    processing = _image_processing(config, spec, tower.patch_size if tower is not None else None)
    limits = ImageLimits(config.max_image_bytes, config.max_image_pixels)
    if tower is None:
        # Vision-language models (ColQwen2, ColPali): images of any size the processor makes; their rules
        # (engine/tasks/vision_retrieval.py) place the features.
        processing = vl_embed_rules.sized_as_its_library(processing, _library_pixels(spec))
        return VisionSpec(processing=processing, limits=limits, patch_size=processing.patch_size)
    if processing.patch_size != tower.patch_size:
        raise ConfigError(
            f"--model {config.path}: preprocessor_config.json's patch_size {processing.patch_size} differs from the "
            f"vision tower's {tower.patch_size}"
        )
    if processing.layout != tower.layout:
        raise ConfigError(
            f"--model {config.path}: its image processor ({processing.layout} layout) does not make the "
            f"{tower.layout} patches its vision tower takes"
        )
    size = _output_size(processing)
    if tower.image_size and size != (tower.image_size, tower.image_size):
        raise ConfigError(
            f"--model {config.path}: preprocessor_config.json makes images of {size or 'varying sizes'}, and the "
            f"vision tower takes {tower.image_size}x{tower.image_size}"
        )
    return VisionSpec(
        processing=processing,
        limits=limits,
        patch_size=tower.patch_size,
        class_token=tower.class_token,
    )


def _library_pixels(spec: ModelSpec) -> tuple[int, int] | None:
    """The (min, max) pixels a vision-language model's own library resizes images to, where it sets them: a yes/no
    reranker's script's (Qwen3-VL-Reranker), else its embedding library's (Qwen3-VL-Embedding)."""
    if isinstance(spec.task.template, VlYesNoTemplate):
        return spec.task.template.pixels
    framing = vl_embed_rules.FRAMINGS.get(spec.family.name)
    return framing.pixels if framing is not None else None


def _image_processing(config: ModelConfig, spec: ModelSpec, patch_size: int | None) -> ImageProcessing:
    try:
        processing = read_image_processing(spec.model_dir) or _processor_image_settings(spec.model_dir, patch_size)
    except ValueError as exc:
        raise ConfigError(f"--model {config.path}: {exc}") from None
    if processing is None:
        raise ConfigError(
            f"--model {config.path}: {spec.info.architecture} takes images, and its directory has no "
            "preprocessor_config.json (the settings its images are resized and normalized with); copy that file "
            "from the model's repository"
        )
    return processing


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


def log_spec(served: ServedModel, config: ModelConfig) -> None:
    info, task = served.info, served.task
    what = ", ".join(t.value for t in info.tasks)
    if task.template is not None:
        what += " (yes/no reranker" + (", from --decoder-reranker)" if config.decoder_reranker else ", from its path)")
    elif task.labels:
        what += f" ({len(task.labels)} labels{', multi-label' if task.multi_label else ''})"
    logger.info(
        "model %s at %s: %s for %s, %s attention (%s) via %s, %s pooling, dim %d, max %d tokens, %s on %s",
        info.name,
        served.spec.model_dir,
        info.architecture,
        what,
        "causal" if info.is_causal else "bidirectional",
        "from --attention" if config.attention else "from the model config",
        info.attention_backend,
        info.pooling,
        info.dimension,
        info.max_input_tokens,
        info.dtype,
        info.device,
    )
    if info.device == "cpu":
        logger.info("model %s: CPU %s", info.name, cpu_isa.detect().summary())
        warning = cpu_isa.dtype_warning(config.torch_dtype_name)
        if warning:
            logger.warning("model %s: %s", info.name, warning)
    if info.kv_shared_layers:
        logger.info(
            "model %s: %d layers reuse an earlier layer's KV cache (%s); --kv-sharing-fast-prefill is %s",
            info.name,
            len(info.kv_shared_layers),
            ", ".join(f"{a}<-{b}" for a, b in info.kv_shared_layers),
            "on: the layers after the last KV writer run only the rows whose output is read"
            if info.kv_sharing_fast_prefill
            else "off",
        )


def _processor_image_settings(model_dir: Path, patch_size: int | None) -> ImageProcessing | None:
    """The image processor's settings inside processor_config.json, where a whole processor saved with
    transformers 5 (sentence-transformers 5.4 on, for one) keeps them instead of preprocessor_config.json."""
    path = model_dir / "processor_config.json"
    if not path.is_file():
        return None
    settings = json.loads(path.read_text()).get("image_processor")
    return processing_from_dict(settings, path, patch_size) if isinstance(settings, dict) else None


def _output_size(processing: ImageProcessing) -> tuple[int, int] | None:
    """(height, width) of every preprocessed image: the crop, else a fixed resize; None when it varies."""
    if processing.crop is not None:
        return tuple(processing.crop)
    if processing.resize is not None and processing.resize[0] == "fixed":
        return tuple(processing.resize[1:])
    return None
