"""Tiny random-weight Gemma 3 and Gemma 4 text models for the parity tests (float32, seeded).

- `build_gemma3_lm`: a Gemma3ForCausalLM with mixed sliding and full layers, a small window, linear RoPE on
  the full layers, q/k norms, query_pre_attn_scalar apart from the head size and final logit softcapping.
- `build_embeddinggemma`: EmbeddingGemma's shape as a sentence-transformers directory: a bidirectional
  Gemma3TextModel (use_bidirectional_attention, sliding windows), mean pooling, two bias-free Identity
  Dense layers, Normalize, and "query: " / "document: " style prompts.
- `build_gemma4_lm`: a Gemma4ForCausalLM whose last half of the layers share the KV of earlier ones
  (num_kv_shared_layers), full layers with a larger head size and fewer KV heads (per_layer_config,
  attention_k_eq_v), proportional RoPE, per-layer inputs, a double-wide MLP on the shared layers, layer
  scalars, final logit softcapping.
- `build_gemma4_embedder`: the same backbone (Gemma4TextModel) as a sentence-transformers directory with
  last-token pooling.

Every model carries the bundled WordPiece tokenizer (tests/helpers/models.py); transformers 5 keeps its
BertTokenizer class for these model types (no Gemma tokenizer is forced), so ours, transformers' and
sentence-transformers' tokenizations agree. Norm weights and layer scalars are perturbed so that loading
mistakes show.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.models import _bundled_tokenizer, _check_weights_saved, _perturb_constant_parameters

# Sliding windows far below the test inputs (prompts up to ~120 tokens, texts up to 128).
GEMMA3_WINDOW = 12
EMBEDDINGGEMMA_WINDOW = 16  # the config stores 16 and halves it on load: 9
GEMMA4_WINDOW = 10
SOFTCAP = 6.0
EMBEDDINGGEMMA_PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "Classification": "task: classification | query: ",
}
# BERT's [PAD], [CLS] and [SEP] for the copied WordPiece vocabulary.
_SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=101, eos_token_id=102)
_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Large enough that random outputs of different texts are well separated.
    initializer_range=0.15,
    **_SPECIAL_TOKENS,
)


def gemma3_config(vocab_size: int, bidirectional: bool = False, **overrides):
    from transformers import Gemma3TextConfig

    settings = dict(
        _COMMON,
        vocab_size=vocab_size,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=EMBEDDINGGEMMA_WINDOW if bidirectional else GEMMA3_WINDOW,
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=None if bidirectional else SOFTCAP,
        use_bidirectional_attention=bidirectional,
    )
    settings.update(overrides)
    return Gemma3TextConfig(**settings)


def gemma4_config(vocab_size: int, **overrides):
    from transformers import Gemma4TextConfig

    settings = dict(
        _COMMON,
        vocab_size=vocab_size,
        num_hidden_layers=6,
        # Layers 3-5 share: 3 and 4 read layer 1's KV (sliding), 5 reads layer 2's (full).
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=3,
        sliding_window=GEMMA4_WINDOW,
        global_head_dim=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        # A narrower per-layer branch (8) is tiny for some tokens, and its RMSNorm then amplifies float32
        # rounding toward 1e-4 in the logits.
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=vocab_size,
        use_double_wide_mlp=True,
        final_logit_softcapping=SOFTCAP,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
    )
    settings.update(overrides)
    return Gemma4TextConfig(**settings)


def _perturb(model, seed: int) -> None:
    """Random norm weights (and biases), and Gemma 4's layer scalars (buffers) away from 1.

    Gemma 4 attends unscaled (scale 1.0) over RMS-normed queries and keys, so with random norm weights near
    1 its scores are as sharp as a softmax gets and float32 rounding is amplified past 1e-4 in the logits
    (transformers' eager and sdpa paths disagree by 2e-4). Halving its q/k norm weights keeps that noise
    near 2e-5, as trained models' norms keep their scores moderate.
    """
    import torch

    _perturb_constant_parameters(model, seed)
    generator = torch.Generator().manual_seed(seed + 2000)
    is_gemma4 = model.config.model_type == "gemma4_text"
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(1.0 + 0.3 * torch.rand(buffer.shape, generator=generator))
        for name, param in model.named_parameters():
            if is_gemma4 and (".q_norm." in name or ".k_norm." in name):
                param.mul_(0.5)


def _save(config, out: Path, model_class, seed: int, max_seq_length: int) -> Path:
    """The copied tokenizer and a random model of model_class, saved as a plain Hugging Face directory."""
    import torch

    tokenizer = _bundled_tokenizer(max_seq_length)
    tokenizer.save_pretrained(str(out))
    torch.manual_seed(seed)
    model = model_class.from_config(config, attn_implementation="eager").eval()
    _perturb(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    _check_weights_saved(out)
    return out


def build_gemma3_lm(tmp_dir: Path | str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    config = gemma3_config(len(_bundled_tokenizer(512)), **overrides)
    return _save(config, Path(tmp_dir) / f"gemma3-lm-s{seed}", AutoModelForCausalLM, seed, 512)


def build_gemma4_lm(tmp_dir: Path | str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    config = gemma4_config(len(_bundled_tokenizer(512)), **overrides)
    name = f"gemma4-lm-s{seed}-" + "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return _save(config, Path(tmp_dir) / name, AutoModelForCausalLM, seed, 512)


def _save_sentence_transformer(hf_dir: Path, out: Path, modules: list, prompts: dict[str, str] | None) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(modules=modules, device="cpu", prompts=prompts)
    st.save(str(out), create_model_card=False)
    _check_weights_saved(out)


def build_embeddinggemma(tmp_dir: Path | str, seed: int = 0, max_seq_length: int = 128) -> Path:
    """EmbeddingGemma's layout at toy size: Transformer, mean Pooling, Dense 64->128, Dense 128->64 (both
    bias-free, Identity), Normalize; its query/document prompts."""
    import torch
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoModel

    tmp_dir = Path(tmp_dir)
    hf_dir = _save(
        gemma3_config(len(_bundled_tokenizer(max_seq_length)), bidirectional=True),
        tmp_dir / f"embeddinggemma-s{seed}-hf",
        AutoModel,
        seed,
        max_seq_length,
    )
    torch.manual_seed(seed + 1)
    modules = [
        Transformer(str(hf_dir), max_seq_length=max_seq_length),
        Pooling(64, pooling_mode="mean"),
        Dense(64, 128, bias=False, activation_function=torch.nn.Identity()),
        Dense(128, 64, bias=False, activation_function=torch.nn.Identity()),
        Normalize(),
    ]
    out = tmp_dir / f"embeddinggemma-s{seed}"
    _save_sentence_transformer(hf_dir, out, modules, EMBEDDINGGEMMA_PROMPTS)
    return out


def build_gemma4_embedder(tmp_dir: Path | str, seed: int = 0, max_seq_length: int = 128) -> Path:
    """A Gemma4TextModel (the LM's backbone shape, KV sharing included) with last-token pooling."""
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoModel

    tmp_dir = Path(tmp_dir)
    hf_dir = _save(
        gemma4_config(len(_bundled_tokenizer(max_seq_length)), final_logit_softcapping=None),
        tmp_dir / f"gemma4-embedder-s{seed}-hf",
        AutoModel,
        seed,
        max_seq_length,
    )
    modules = [
        Transformer(str(hf_dir), max_seq_length=max_seq_length),
        Pooling(64, pooling_mode="lasttoken"),
        Normalize(),
    ]
    out = tmp_dir / f"gemma4-embedder-s{seed}"
    _save_sentence_transformer(hf_dir, out, modules, None)
    return out


def with_config(model_dir: Path, out: Path, **changes) -> Path:
    """A copy of model_dir (links to its files and folders) whose config.json has `changes` applied."""
    out.mkdir()
    for path in model_dir.iterdir():
        if path.name != "config.json":
            (out / path.name).symlink_to(path)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
