"""The models benchmarks/peers.py runs every peer on: the bundled all-MiniLM-L6-v2, and random-weight models in
the exact shapes of bge-base-en-v1.5, bge-large-en-v1.5, Qwen3-Embedding-0.6B, modernbert-embed-base and
all-mpnet-base-v2.

Nothing is downloaded. A random model is a sentence-transformers directory (modules.json, 1_Pooling,
sentence_bert_config.json, config.json, model.safetensors and the bundled model's WordPiece tokenizer),
built once (seeded) into a cache directory and reused. Its files are written in the classic layout that
every peer reads: sentence-transformers 3.4 (Infinity) to 6.x, transformers 4.57 to 5.x, vLLM. Vocabulary
size only changes the embedding table, not the compute, so the shapes' throughput stands for the real models'.
The Qwen3 shape keeps the WordPiece tokenizer too: every peer's tokenizer gives the same ids with it (unlike
transformers 5 on qwen2, it forces no Qwen2Tokenizer on qwen3), and [SEP] ends each input where the real
model's tokenizer appends <|endoftext|>, so last-token pooling reads one fixed token as it does there.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from embedserv.config import bundled_model_path

MINILM = "minilm"
# Files of the bundled tokenizer copied into every random model, so that all peers read the same one.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "special_tokens_map.json", "tokenizer_config.json")
POOLING_KEYS = {
    "cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken",
}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """A published model's architecture, with the pooling its sentence-transformers files name."""

    model_type: str  # "bert", "qwen3", "modernbert" or "mpnet"
    config: dict
    pooling: str
    max_seq_length: int


# Random post-LayerNorm BERTs give nearly the same CLS vector for every text at transformers' default std 0.02
# (pairwise cosine 0.975 on the benchmark texts), too close to the 0.99 flag for the cosine check to catch a
# peer that embeds the wrong tokens; std 0.1 brings it to 0.90. The Qwen3 shape is well apart at 0.02 (0.50).
BERT_INIT_STD = 0.1
SHAPES = {
    "bge-base": Shape("bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                   intermediate_size=3072, initializer_range=BERT_INIT_STD), "cls", 512),
    "bge-large": Shape("bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                    intermediate_size=4096, initializer_range=BERT_INIT_STD), "cls", 512),
    # Qwen3-Embedding-0.6B's config.json; 512 tokens is the benchmark's truncation, not the model's limit.
    "qwen3-0.6b": Shape("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                      num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                      max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                                      tie_word_embeddings=True), "lasttoken", 512),
    # modernbert-embed-base (ModernBERT-base): 22 layers, every third global, the others see 128 tokens; 8,192
    # positions, of which the benchmark truncates at 512 as for the other shapes.
    "modernbert-base": Shape("modernbert", dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                                                intermediate_size=1152, global_attn_every_n_layers=3,
                                                local_attention=128, max_position_embeddings=8192,
                                                initializer_range=BERT_INIT_STD), "mean", 512),
    # Compute nearly free (one layer, 64 wide): what a server's host path allows (benchmarks/host_ceiling.py).
    "host-tiny": Shape("bert", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                                    intermediate_size=128, initializer_range=BERT_INIT_STD), "mean", 128),
    # all-mpnet-base-v2: BERT-base sizes with MPNet's shared relative position bias; 384 tokens.
    "mpnet-base": Shape("mpnet", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                      intermediate_size=3072, max_position_embeddings=514,
                                      initializer_range=BERT_INIT_STD), "mean", 384),
}  # fmt: skip
MODEL_NAMES = (MINILM, *SHAPES)


def model_dir(name: str, cache: Path, seed: int = 0) -> Path:
    """The directory of model `name`: the bundled MiniLM, or the random model built (once) under cache/name."""
    if name == MINILM:
        return bundled_model_path()
    if name not in SHAPES:
        raise ValueError(f"model must be one of {MODEL_NAMES}, not {name!r}")
    out = Path(cache) / name
    if not (out / "modules.json").exists():
        build_random_model(SHAPES[name], out, seed)
    return out


def max_seq_length(directory: Path) -> int:
    return json.loads((Path(directory) / "sentence_bert_config.json").read_text())["max_seq_length"]


def build_random_model(shape: Shape, out: Path, seed: int = 0) -> Path:
    """Seeded random weights (transformers' own init from the config, std = initializer_range) saved as a
    sentence-transformers directory; built in a sibling directory first, so an interrupted build leaves no
    half model behind."""
    import torch
    from transformers import AutoModel

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _copy_tokenizer(tmp, shape)
    config = _hf_config(shape, vocab_size=_vocab_size(tmp))
    torch.manual_seed(seed)
    model = AutoModel.from_config(config).eval()
    model.save_pretrained(str(tmp), safe_serialization=True)
    _write_portable_config(tmp / "config.json", shape)
    _write_sentence_transformers_files(tmp, shape, config.hidden_size)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _copy_tokenizer(out: Path, shape: Shape) -> None:
    source = bundled_model_path()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, out / name)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = shape.max_seq_length
    if shape.model_type in ("modernbert", "mpnet"):
        # Their own tokenizers make no token types, and transformers 4.x's ModernBertModel refuses them.
        tokenizer_config["model_input_names"] = ["input_ids", "attention_mask"]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _vocab_size(directory: Path) -> int:
    return len(json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"])


def _hf_config(shape: Shape, vocab_size: int):
    from transformers import BertConfig, ModernBertConfig, MPNetConfig, Qwen3Config

    if shape.model_type == "bert":
        return BertConfig(vocab_size=vocab_size, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0,
                          hidden_act="gelu", layer_norm_eps=1e-12, **shape.config)  # fmt: skip
    # The WordPiece tokenizer's ids: [PAD] 0, [CLS] 101, [SEP] 102.
    if shape.model_type == "modernbert":
        return ModernBertConfig(vocab_size=vocab_size, pad_token_id=0, bos_token_id=101, eos_token_id=102,
                                cls_token_id=101, sep_token_id=102, **shape.config)  # fmt: skip
    if shape.model_type == "mpnet":
        return MPNetConfig(vocab_size=vocab_size, pad_token_id=0, bos_token_id=101, eos_token_id=102,
                           hidden_act="gelu", layer_norm_eps=1e-5, **shape.config)  # fmt: skip
    options = dict(shape.config)
    rope_theta = options.pop("rope_theta")
    # The WordPiece tokenizer's [PAD] is 0; Qwen3's own ids do not exist in this vocabulary.
    return Qwen3Config(vocab_size=vocab_size, pad_token_id=0, bos_token_id=101, eos_token_id=102, hidden_act="silu",
                       attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                       **options)  # fmt: skip


def _write_portable_config(path: Path, shape: Shape) -> None:
    """config.json that transformers 4.57 (the sentence-transformers and Infinity venvs) reads the same way as 5.x.

    transformers 5 writes RoPE as `rope_parameters`; 4.x only knows a top-level `rope_theta` and would fall back
    to 10000. vLLM has no class for the bare `Qwen3Model`, and Qwen3-Embedding-0.6B itself names
    `Qwen3ForCausalLM` over bare backbone weights, so this does too."""
    config = json.loads(path.read_text())
    if shape.model_type == "modernbert":
        # 4.x reads one theta per layer kind from these keys; 5.x from rope_parameters, kept beside them.
        rope = config["rope_parameters"]
        config["global_rope_theta"] = rope["full_attention"]["rope_theta"]
        config["local_rope_theta"] = rope["sliding_attention"]["rope_theta"]
        path.write_text(json.dumps(config, indent=2))
        return
    rope = config.pop("rope_parameters", None)
    if rope is not None:
        config["rope_theta"] = rope["rope_theta"]
        config["rope_scaling"] = None
    if shape.model_type == "qwen3":
        config["architectures"] = ["Qwen3ForCausalLM"]
    path.write_text(json.dumps(config, indent=2))


def _write_sentence_transformers_files(out: Path, shape: Shape, hidden_size: int) -> None:
    """modules.json (Transformer, Pooling, Normalize) with the module paths every sentence-transformers reads."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    pooling = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "include_prompt": True,
    }
    pooling.update({key: mode == shape.pooling for mode, key in POOLING_KEYS.items()})
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out / "2_Normalize").mkdir(exist_ok=True)
    st_config = {"max_seq_length": shape.max_seq_length, "do_lower_case": False}
    (out / "sentence_bert_config.json").write_text(json.dumps(st_config, indent=2))


def pooling_mode(directory: Path) -> str:
    """The pooling the model's 1_Pooling/config.json names: cls, mean, lasttoken, or "other"."""
    config = json.loads((Path(directory) / "1_Pooling" / "config.json").read_text())
    return next((mode for mode, key in POOLING_KEYS.items() if config.get(key)), "other")
