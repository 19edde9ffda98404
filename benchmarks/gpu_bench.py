"""The benchmark bodies of gpu_check.py, on any device: random-weight model builders, and one function per
system that gpu_check runs in a fresh process of its own (`isolated`), so no system inherits another's
allocator state, compiled kernels or thread teams.

Timing follows embed_throughput.py and generate_throughput.py, whose helpers these reuse: one untimed pass
over all the work, then the best of `repeats` timed passes. Every timed function returns host results, so
the device has finished when the clock stops (the engine and sentence-transformers hand back numpy arrays;
transformers' generate is synchronized explicitly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.embed_throughput import best_of, chunked


@dataclass(frozen=True)
class BertShape:
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 3072
    max_length: int = 512

    def describe(self) -> str:
        return f"random BERT {self.layers}x{self.hidden}, {self.heads} heads"


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 2816

    def describe(self) -> str:
        return f"random Llama {self.layers}x{self.hidden}, {self.heads}/{self.kv_heads} heads"


def _tokenizer(tokenizer_dir: Path, max_length: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.model_max_length = max_length
    return tokenizer


def build_bert(out: Path, tokenizer_dir: Path, shape: BertShape) -> Path:
    """A sentence-transformers BERT (CLS pooling, as bge-base) with random weights in safetensors, and the
    WordPiece tokenizer of tokenizer_dir. Random weights change no timing."""
    import torch
    from transformers import BertConfig, BertModel

    tokenizer = _tokenizer(tokenizer_dir, shape.max_length)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, intermediate_size=shape.intermediate, max_position_embeddings=512,
        type_vocab_size=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": shape.hidden,
        "pooling_mode_cls_token": True,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
    }
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    st_config = {"max_seq_length": shape.max_length, "do_lower_case": True}
    (out / "sentence_bert_config.json").write_text(json.dumps(st_config, indent=2))
    return out


def build_llama(out: Path, tokenizer_dir: Path, shape: LlamaShape) -> Path:
    """A causal Llama with random weights in safetensors and the WordPiece tokenizer of tokenizer_dir (as
    generate_throughput.py builds its model, in another shape)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tokenizer(tokenizer_dir, 2048)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5, pad_token_id=0,
        bos_token_id=101, eos_token_id=102,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def embed_engine(model: str, texts: list[str], dtype: str, device: str, batch_size: int, repeats: int) -> dict:
    """embedserv in process: the texts as concurrent calls of batch_size, as concurrent clients send them."""
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine
    from embedserv.types import EmbedParams

    params = EmbedParams(truncate=True)
    calls = chunked(texts, batch_size)
    with SyncEngine(ModelConfig(path=model, served_name="bench", device=device, dtype=dtype)) as engine:
        backend = engine.info.attention_backend
        seconds, results = best_of(repeats, lambda: engine.embed_concurrently(calls, params))
    return {"seconds": seconds, "tokens": sum(r.prompt_tokens for r in results), "note": backend}


# Dense float16/bfloat16 tensor-core peaks (no sparsity), TFLOP/s, from the vendors' data sheets.
PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312, "L40S": 362, "L4": 121, "A10": 125}


def bert_flops_per_token(shape: BertShape, length: int) -> float:
    """Forward FLOPs per token of a sequence of `length`: the linears (2 per weight) and attention's two
    matmuls (2 * length * hidden each), per layer."""
    linear_weights = 4 * shape.hidden**2 + 2 * shape.hidden * shape.intermediate
    return shape.layers * (2 * linear_weights + 4 * length * shape.hidden)


def embed_mfu(model: str, shape: BertShape, dtype: str, device: str, repeats: int) -> dict:
    """embedserv in process on 512-token inputs (256 texts cut at the model's 512-token limit), as TFLOP/s
    and the share of the GPU's dense peak (model FLOPs utilization)."""
    import torch

    texts = ["token " * (2 * shape.max_length)] * 256
    result = embed_engine(model, texts, dtype, device, 32, repeats)
    length = result["tokens"] // len(texts)
    tflops = result["tokens"] * bert_flops_per_token(shape, length) / result["seconds"] / 1e12
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    peak = next((value for key, value in PEAK_TFLOPS.items() if key in name), None)
    mfu = f", MFU {tflops / peak:.0%} of {name}'s {peak} TFLOP/s" if peak else f" ({name}: peak unknown)"
    return result | {"note": f"{length}-token inputs: {tflops:.3g} TFLOP/s{mfu}"}


def embed_sentence_transformers(model: str, texts: list[str], device: str, batch_size: int, repeats: int) -> dict:
    """sentence-transformers in float16 (`.half()`), its usual GPU setting."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device=device).half()
    seconds, _ = best_of(repeats, lambda: st.encode(texts, batch_size=batch_size, convert_to_numpy=True))
    return {"seconds": seconds}


def generate_engine(model: str, streams: int, max_tokens: int, dtype: str, device: str, repeats: int) -> dict:
    """embedserv in process: `streams` greedy generations submitted at once (continuous batching)."""
    from benchmarks.generate_throughput import bench_engine

    return bench_engine(model, streams, max_tokens, dtype, repeats, device=device)


def generate_transformers(model: str, streams: int, max_tokens: int, dtype: str, device: str, repeats: int) -> dict:
    """transformers' generate on the same prompts as one left-padded batch (generate_throughput.py)."""
    from benchmarks.generate_throughput import bench_transformers

    return bench_transformers(model, streams, max_tokens, dtype, repeats, device=device)
