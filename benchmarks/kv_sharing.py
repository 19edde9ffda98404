"""Cross-layer KV sharing: what --kv-sharing-fast-prefill saves, and the blocks sharing frees.

    python benchmarks/kv_sharing.py [--prompt-tokens 2048] [--repeats 3] [--dtype float32] [--device cpu]

The model is a random-weight Gemma 4 text model built here (nothing downloaded) in a scaled-down Gemma
4 E2B shape: hidden 512, 12 layers (five sliding to one full), the last 6 reading the KV of earlier
layers (num_kv_shared_layers), 8 query heads, sliding layers 2 KV heads of 64, full layers 1 of 128,
per-layer inputs of 64, double-wide MLPs on the shared layers, a 512-token window, the bundled
tokenizer's 30k vocabulary. Rows, each skip off then on, each in its own process (one untimed pass,
then --repeats timed passes; the fastest counts):
- time to first token of one --prompt-tokens prompt (Generate, max_tokens 1): the whole prefill, chunked
  by the engine's default step budget;
- embed: 8 inputs of --prompt-tokens / 2 tokens through the backbone with last-token pooling;
- rerank: one query over 16 documents of about --prompt-tokens / 2 tokens through the LM as a yes/no
  reranker.
Blocks per GiB: the same model's KV cache per block with and without sharing (float32 and bfloat16).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.corpus import stdlib_texts  # noqa: E402
from benchmarks.embed_throughput import isolated  # noqa: E402
from embedserv import cpu_isa  # noqa: E402
from embedserv.config import ModelConfig  # noqa: E402

E2B_SHAPE = dict(
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_kv_shared_layers=6,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    hidden_size_per_layer_input=64,
    use_double_wide_mlp=True,
    sliding_window=512,
    max_position_embeddings=8192,
    final_logit_softcapping=30.0,
    initializer_range=0.02,
)


def build_models(root: Path, lm_tokens: int, embed_tokens: int) -> dict[str, Path]:
    """The causal LM, the same LM as a yes/no reranker (a directory named so), the last-token embedder."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoModel, AutoModelForCausalLM

    from tests.helpers.gemma_models import _bundled_tokenizer, _save, gemma4_config, with_config

    vocab = len(_bundled_tokenizer(lm_tokens))
    lm = _save(gemma4_config(vocab, **E2B_SHAPE), root / "gemma4-lm", AutoModelForCausalLM, 0, lm_tokens)
    reranker = with_config(lm, root / "gemma4-reranker")
    backbone = _save(
        gemma4_config(vocab, **dict(E2B_SHAPE, final_logit_softcapping=None)),
        root / "gemma4-backbone",
        AutoModel,
        0,
        embed_tokens,
    )
    transformer = Transformer(str(backbone), max_seq_length=embed_tokens)
    st = SentenceTransformer(modules=[transformer, Pooling(512, pooling_mode="lasttoken"), Normalize()], device="cpu")
    st.save(str(root / "gemma4-embedder"), create_model_card=False)
    return {"lm": lm, "reranker": reranker, "embedder": root / "gemma4-embedder"}


def long_text(words: int, seed: int) -> str:
    pool = " ".join(stdlib_texts(400, seed=seed)).split()
    return " ".join(pool[:words])


def _best(run, repeats: int) -> float:
    run()
    return min(run() for _ in range(repeats))


def bench(kind: str, model: Path, skip: bool, prompt_tokens: int, repeats: int, dtype: str, device: str) -> dict:
    from embedserv.engine.sync import SyncEngine
    from embedserv.types import EmbedParams, RerankParams, SamplingParams

    config = ModelConfig(
        path=str(model),
        served_name="m",
        dtype=dtype,
        device=device,
        kv_sharing_fast_prefill=skip,
        kv_cache_memory=2**30 if kind == "ttft" else None,
        enable_prefix_caching=False,
    )
    with SyncEngine(config) as engine:
        # About 1.3 WordPiece tokens a word: embed inputs are cut at their token count (the tokenizer's
        # limit); prompts and documents are about as long (the prompt's count is reported).
        words = int(prompt_tokens / 1.3)
        if kind == "ttft":
            prompt = [long_text(words, seed=3)]
            params = [SamplingParams(max_tokens=1, ignore_eos=True)]
            counted = []

            def run() -> float:
                start = time.perf_counter()
                deltas = engine.generate_concurrently(prompt, params)[0]
                seconds = time.perf_counter() - start
                counted.append(deltas[-1].prompt_tokens)
                return seconds

            return {"seconds": _best(run, repeats), "tokens": counted[-1]}
        if kind == "embed":
            texts = [long_text(words + 50, seed=10 + i) for i in range(8)]
            params = EmbedParams(truncate=True)

            def run() -> float:
                start = time.perf_counter()
                engine.embed(texts, params)
                return time.perf_counter() - start

            return {"seconds": _best(run, repeats), "tokens": f"~{prompt_tokens}"}
        documents = [long_text(words, seed=30 + i) for i in range(16)]
        params = RerankParams(truncate=True)

        def run() -> float:
            start = time.perf_counter()
            engine.rerank("which module parses command line arguments", documents, params)
            return time.perf_counter() - start

        return {"seconds": _best(run, repeats), "tokens": f"~{prompt_tokens}"}


def blocks_per_gib(model: Path, shared: bool, dtype: torch.dtype, block_size: int = 16) -> int:
    from embedserv.models.families.gemma4 import Gemma4Model
    from embedserv.models.loading.hf_config import read_hf_config
    from embedserv.worker.kv_cache import kv_cache_groups

    config = read_hf_config(model)
    if not shared:
        config.num_kv_shared_layers = 0
    with torch.device("meta"):
        groups = kv_cache_groups(Gemma4Model(config), block_size, dtype)
    return 2**30 // sum(group.bytes_per_block for group in groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"{cpu_isa.detect().summary()}, torch {torch.__version__}, {args.dtype} on {args.device}")
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp), args.prompt_tokens + 256, args.prompt_tokens // 2)
        rows = [
            ("time to first token", "ttft", models["lm"], args.prompt_tokens),
            ("embed, last-token pooling (8 inputs)", "embed", models["embedder"], args.prompt_tokens // 2),
            ("rerank, yes/no (16 documents)", "rerank", models["reranker"], args.prompt_tokens // 2),
        ]
        print("\n| workload | tokens per input | skip off (s) | skip on (s) | speed-up |")
        print("|---|---|---|---|---|")
        for title, kind, model, tokens in rows:
            off, on = (
                isolated(bench, kind, model, skip, tokens, args.repeats, args.dtype, args.device)
                for skip in (False, True)
            )
            print(
                f"| {title} | {on['tokens']} | {off['seconds']:.3f} | {on['seconds']:.3f} | "
                f"{off['seconds'] / on['seconds']:.2f}x |"
            )
        print("\n| KV cache | blocks of 16 tokens per GiB, float32 | bfloat16 |")
        print("|---|---|---|")
        for shared in (False, True):
            fp32, bf16 = (blocks_per_gib(models["lm"], shared, dtype) for dtype in (torch.float32, torch.bfloat16))
            print(f"| {'6 of 12 layers shared' if shared else 'no sharing'} | {fp32} | {bf16} |")


if __name__ == "__main__":
    main()
