"""Tiny random-weight ModernBERT and EuroBERT models for the parity tests (float32, seeded).

- `build_modernbert_embedder`: a ModernBertModel as a sentence-transformers directory (CLS or mean pooling),
  four layers alternating global and local attention (global_attn_every_n_layers 2) with a local window of
  LOCAL_ATTENTION tokens, far below the test inputs (up to 128 tokens), and rotary thetas of their own.
- `build_modernbert_classifier`: a ModernBertForSequenceClassification cross-encoder (classifier_pooling
  "cls" or "mean"); `biases=True` turns every bias switch on (attention, MLP, norms, classifier dense).
- `published_form`: the same weights as the published checkpoints carry them: config.json as transformers
  4.48+ wrote it (global_attn_every_n_layers, global_rope_theta / local_rope_theta; no layer_types or
  rope_parameters) and ModernBertForMaskedLM tensor names (`model.` prefix, `head.*`, `decoder.bias`), as
  answerdotai/ModernBERT-base ships.

Every model carries the bundled WordPiece tokenizer (tests/helpers/models.py); norm weights and biases are
perturbed so that loading mistakes show.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.models import (
    _bundled_tokenizer,
    _check_weights_saved,
    _perturb_constant_parameters,
    _save_sentence_transformer,
)
from tests.helpers.scorers import CROSS_ENCODER_HEAD_SCALE, _label_maps

# Each token sees 8 on each side (transformers keeps |p - j| <= local_attention // 2).
LOCAL_ATTENTION = 16
GLOBAL_THETA = 160_000.0
LOCAL_THETA = 10_000.0
NUM_LAYERS = 4
GLOBAL_EVERY = 2
# BERT's [PAD], [CLS] and [SEP] for the copied WordPiece vocabulary.
_SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=101, cls_token_id=101, eos_token_id=102, sep_token_id=102)


def modernbert_config(vocab_size: int, biases: bool = False, **overrides):
    from transformers import ModernBertConfig

    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        max_position_embeddings=512,
        layer_types=["full_attention" if i % GLOBAL_EVERY == 0 else "sliding_attention" for i in range(NUM_LAYERS)],
        local_attention=LOCAL_ATTENTION,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": GLOBAL_THETA},
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA},
        },
        # Large enough that random outputs of different texts are well separated.
        initializer_range=0.15,
        attention_bias=biases,
        mlp_bias=biases,
        norm_bias=biases,
        classifier_bias=biases,
        **_SPECIAL_TOKENS,
    )
    settings.update(overrides)
    return ModernBertConfig(**settings)


def _save_hf(config, out: Path, model_class, seed: int, max_seq_length: int, head_scale: float = 1.0) -> Path:
    import torch

    tokenizer = _bundled_tokenizer(max_seq_length)
    tokenizer.save_pretrained(str(out))
    torch.manual_seed(seed)
    model = model_class.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    if head_scale != 1.0:
        with torch.no_grad():
            model.classifier.weight.mul_(head_scale)
    model.save_pretrained(str(out), safe_serialization=True)
    _check_weights_saved(out)
    return out


def build_modernbert_embedder(
    tmp_dir: Path | str, pooling: str, seed: int = 0, max_seq_length: int = 128, **overrides
) -> Path:
    from transformers import AutoModel

    name = f"modernbert-{pooling}-s{seed}-L{max_seq_length}" + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    hf_dir = _save_hf(
        modernbert_config(len(_bundled_tokenizer(max_seq_length)), **overrides),
        Path(tmp_dir) / f"{name}-hf",
        AutoModel,
        seed,
        max_seq_length,
    )
    out = Path(tmp_dir) / name
    _save_sentence_transformer(hf_dir, out, pooling, max_seq_length, prompts=None)
    return out


def build_modernbert_classifier(
    tmp_dir: Path | str,
    pooling: str,
    num_labels: int = 3,
    seed: int = 0,
    biases: bool = False,
    max_seq_length: int = 128,
) -> Path:
    """A ModernBertForSequenceClassification with `classifier_pooling` = pooling ("cls" or "mean")."""
    from transformers import AutoModelForSequenceClassification

    config = modernbert_config(
        len(_bundled_tokenizer(max_seq_length)),
        biases=biases,
        classifier_pooling=pooling,
        num_labels=num_labels,
        **_label_maps(num_labels),
    )
    name = f"modernbert-cls-{pooling}-n{num_labels}-s{seed}" + ("-biases" if biases else "")
    return _save_hf(
        config,
        Path(tmp_dir) / name,
        AutoModelForSequenceClassification,
        seed,
        max_seq_length,
        head_scale=CROSS_ENCODER_HEAD_SCALE,
    )


def published_form(model_dir: Path, out: Path) -> Path:
    """A copy of a ModernBertModel directory in the published form (module docstring): old-style config.json,
    ModernBertForMaskedLM tensor names with a random MLM head (which an embedder must ignore)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    layer_types = config.pop("layer_types")
    rope = config.pop("rope_parameters")
    every = GLOBAL_EVERY
    if layer_types != ["full_attention" if i % every == 0 else "sliding_attention" for i in range(len(layer_types))]:
        raise ValueError(f"layer types {layer_types} are not every {every}th layer global")
    config.update(
        architectures=["ModernBertForMaskedLM"],
        global_attn_every_n_layers=every,
        global_rope_theta=rope["full_attention"]["rope_theta"],
        local_rope_theta=rope["sliding_attention"]["rope_theta"],
        reference_compile=None,
        transformers_version="4.48.0",
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))

    weights = load_file(str(out / "model.safetensors"))
    renamed = {f"model.{name}": tensor for name, tensor in weights.items()}
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(7)
    renamed["head.dense.weight"] = torch.randn(hidden, hidden, generator=generator)
    renamed["head.norm.weight"] = torch.randn(hidden, generator=generator)
    renamed["decoder.bias"] = torch.randn(vocab, generator=generator)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# EuroBERT (Llama's architecture as a bidirectional encoder): grouped KV heads, a RoPE theta of its own.
EUROBERT_THETA = 250_000.0


def eurobert_config(vocab_size: int, **overrides):
    from transformers import EuroBertConfig

    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": EUROBERT_THETA},
        initializer_range=0.15,
        pad_token_id=0,
        bos_token_id=101,
        eos_token_id=102,
        mask_token_id=103,
    )
    settings.update(overrides)
    return EuroBertConfig(**settings)


def build_eurobert_embedder(tmp_dir: Path | str, pooling: str, seed: int = 0, max_seq_length: int = 128) -> Path:
    from transformers import AutoModel

    name = f"eurobert-{pooling}-s{seed}-L{max_seq_length}"
    hf_dir = _save_hf(
        eurobert_config(len(_bundled_tokenizer(max_seq_length))),
        Path(tmp_dir) / f"{name}-hf",
        AutoModel,
        seed,
        max_seq_length,
    )
    out = Path(tmp_dir) / name
    _save_sentence_transformer(hf_dir, out, pooling, max_seq_length, prompts=None)
    return out


def build_eurobert_classifier(
    tmp_dir: Path | str, pooling: str, num_labels: int = 3, seed: int = 0, max_seq_length: int = 128
) -> Path:
    """A EuroBertForSequenceClassification with `classifier_pooling` = pooling ("bos", "mean" or "late")."""
    from transformers import AutoModelForSequenceClassification

    config = eurobert_config(
        len(_bundled_tokenizer(max_seq_length)),
        classifier_pooling=pooling,
        num_labels=num_labels,
        **_label_maps(num_labels),
    )
    return _save_hf(
        config,
        Path(tmp_dir) / f"eurobert-cls-{pooling}-n{num_labels}-s{seed}",
        AutoModelForSequenceClassification,
        seed,
        max_seq_length,
        head_scale=CROSS_ENCODER_HEAD_SCALE,
    )


def eurobert_published_form(model_dir: Path, out: Path) -> Path:
    """A copy of a EuroBERT directory with config.json as the published checkpoints carry it: custom code
    (auto_map), `rope_theta` / `rope_scaling` instead of rope_parameters, `clf_pooling` for the classifier's
    pooling, and the other keys its custom config class keeps; a classifier's output layer as `out_proj`."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(
        auto_map={
            "AutoConfig": "configuration_eurobert.EuroBertConfig",
            "AutoModel": "modeling_eurobert.EuroBertModel",
            "AutoModelForMaskedLM": "modeling_eurobert.EuroBertForMaskedLM",
            "AutoModelForSequenceClassification": "modeling_eurobert.EuroBertForSequenceClassification",
        },
        rope_theta=rope["rope_theta"],
        rope_scaling=None,
        clf_pooling=config.pop("classifier_pooling", "late"),
        pretraining_tp=1,
        transformers_version="4.48.0",
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _rename_tensors(out / "model.safetensors", "classifier.", "out_proj.")
    return out


def _rename_tensors(path: Path, prefix: str, new_prefix: str) -> None:
    """The first published custom code names the classifier's output layer `out_proj`."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    renamed = {new_prefix + name[len(prefix) :] if name.startswith(prefix) else name: t for name, t in weights.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})
