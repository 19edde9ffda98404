"""Encoder-decoder models: T5 generation tokens/s at 1, 8 and 32 concurrent streams against transformers'
batched generate, and monoT5 rerank pairs/s against a batched transformers loop; same run, same inputs.

    python benchmarks/seq2seq_throughput.py [--streams 1,8,32] [--max-tokens 32] [--pairs 256] [--device cpu]

Models are random-weight T5s built here (nothing downloaded) with a trained Unigram tokenizer of a few
thousand pieces (so the LM head is far cheaper than a real 32k vocabulary's):
- generation: Flan-T5-small's shape (T5 v1.1, d_model 512, 8 + 8 layers, 6 heads of 64, d_ff 1024, untied);
  prompts are real texts of 30 to 90 words (encoder inputs); every stream generates exactly --max-tokens
  tokens (EOS ignored). embedserv: N generations submitted at once (continuous batching; each encoder runs
  once, in its request's first step, into the cross KV cache). transformers: one `generate` call on the N
  prompts, right-padded, greedy, `min_new_tokens` = max.
- rerank: monoT5 on t5-small's shape (T5 v1.0, d_model 512, 6 + 6 layers, 8 heads, d_ff 2048, tied): one
  query against --pairs documents. embedserv: one Rerank call (encoder + one decoder step per pair, KV-free,
  batched by the scheduler). transformers: batches of 32 `Query: q Document: d Relevant:` inputs with
  decoder input [start], softmax over the [false, true] logits.
Each system runs in its own process: one untimed pass, then --repeats timed passes; the fastest counts.
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
from benchmarks.generate_throughput import _timed  # noqa: E402
from embedserv import cpu_isa  # noqa: E402
from embedserv.config import ModelConfig  # noqa: E402

FLAN_T5_SMALL = dict(
    variant="v1.1",
    tied=False,
    d_model=512,
    d_kv=64,
    d_ff=1024,
    num_layers=8,
    num_decoder_layers=8,
    num_heads=6,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    initializer_factor=1.0,
)
T5_SMALL = dict(
    d_model=512,
    d_kv=64,
    d_ff=2048,
    num_layers=6,
    num_decoder_layers=6,
    num_heads=8,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    initializer_factor=1.0,
)


def prompts(count: int) -> list[str]:
    texts = stdlib_texts(count, seed=41)
    return [" ".join(t.split()[: 30 + (i * 7) % 60]) for i, t in enumerate(texts)]


def rerank_workload(num_documents: int) -> tuple[str, list[str]]:
    texts = stdlib_texts(num_documents + 1, seed=43)
    return " ".join(texts[0].split()[:12]), [" ".join(t.split()[:60]) for t in texts[1:]]


def bench_engine_generate(model: str, streams: int, max_tokens: int, dtype: str, repeats: int, device: str) -> dict:
    from embedserv.engine.sync import SyncEngine
    from embedserv.types import SamplingParams

    texts = prompts(streams)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * streams
    config = ModelConfig(path=model, served_name="m", device=device, dtype=dtype, kv_cache_memory=2**30)
    with SyncEngine(config) as engine:

        def run() -> dict:
            start = time.perf_counter()
            results = engine.generate_concurrently(texts, params)
            tokens = sum(len(d.token_ids) for r in results for d in r)
            assert tokens == streams * max_tokens, tokens
            return {"wall_s": time.perf_counter() - start, "tokens": tokens}

        return dict(_timed(run, repeats), note=engine.info.attention_backend)


def bench_transformers_generate(
    model: str, streams: int, max_tokens: int, dtype: str, repeats: int, device: str
) -> dict:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForSeq2SeqLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    batch = tokenizer(prompts(streams), return_tensors="pt", padding=True).to(device)

    def run() -> dict:
        start = time.perf_counter()
        with torch.inference_mode():
            out = lm.generate(
                **batch,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                num_beams=1,
            ).cpu()
        # The output starts with the decoder start token.
        return {"wall_s": time.perf_counter() - start, "tokens": (out.shape[1] - 1) * streams}

    return _timed(run, repeats)


def bench_engine_rerank(model: str, num_documents: int, dtype: str, repeats: int, device: str) -> dict:
    from embedserv.engine.sync import SyncEngine
    from embedserv.types import RerankParams

    query, documents = rerank_workload(num_documents)
    config = ModelConfig(path=model, served_name="m", device=device, dtype=dtype)
    with SyncEngine(config) as engine:

        def run() -> dict:
            start = time.perf_counter()
            result = engine.rerank(query, documents, RerankParams())
            assert len(result.results) == num_documents
            return {"wall_s": time.perf_counter() - start, "pairs": num_documents}

        return dict(_timed(run, repeats), note=engine.info.attention_backend)


def bench_transformers_rerank(model: str, num_documents: int, dtype: str, repeats: int, device: str) -> dict:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForSeq2SeqLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    true_id, false_id = tokenizer.convert_tokens_to_ids(["▁true", "▁false"])
    query, documents = rerank_workload(num_documents)
    texts = [f"Query: {query} Document: {d} Relevant:" for d in documents]
    start_id = lm.config.decoder_start_token_id

    def run() -> dict:
        start = time.perf_counter()
        scores = []
        with torch.inference_mode():
            for i in range(0, len(texts), 32):
                batch = tokenizer(texts[i : i + 32], return_tensors="pt", padding=True, truncation=True).to(device)
                decoder = torch.full((batch.input_ids.shape[0], 1), start_id, device=device)
                logits = lm(**batch, decoder_input_ids=decoder).logits[:, 0, [false_id, true_id]]
                scores.append(logits.float().softmax(-1)[:, 1].cpu())
        assert sum(len(s) for s in scores) == num_documents
        return {"wall_s": time.perf_counter() - start, "pairs": num_documents}

    return _timed(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from tests.helpers.seq2seq_models import build_tiny_monot5, build_tiny_t5

    gen_rows, rerank_row = [], None
    with tempfile.TemporaryDirectory() as tmp:
        t5 = str(build_tiny_t5(tmp, name="flan-t5-small-shape", **FLAN_T5_SMALL))
        monot5 = str(build_tiny_monot5(tmp, name="monot5-small-shape", **T5_SMALL))
        common = (args.dtype, args.repeats, args.device)
        for streams in [int(s) for s in args.streams.split(",")]:
            ours = isolated(bench_engine_generate, t5, streams, args.max_tokens, *common)
            theirs = isolated(bench_transformers_generate, t5, streams, args.max_tokens, *common)
            gen_rows.append((streams, ours, theirs))
            print(f"done generate x{streams}", file=sys.stderr, flush=True)
        rerank_row = (
            isolated(bench_engine_rerank, monot5, args.pairs, *common),
            isolated(bench_transformers_rerank, monot5, args.pairs, *common),
        )

    print(
        f"\n{cpu_isa.detect().summary()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.device}, {args.dtype}; best of {args.repeats}\n"
    )
    print(f"Generation (Flan-T5-small shape), {args.max_tokens} new tokens per stream:\n")
    print("| streams | transformers tok/s | embedserv tok/s | speed-up | backend |")
    print("|---:|---:|---:|---:|---|")
    for streams, ours, theirs in gen_rows:
        ours_rate, theirs_rate = ours["tokens"] / ours["wall_s"], theirs["tokens"] / theirs["wall_s"]
        print(f"| {streams} | {theirs_rate:.0f} | {ours_rate:.0f} | {ours_rate / theirs_rate:.2f}x | {ours['note']} |")
    ours, theirs = rerank_row
    ours_rate, theirs_rate = ours["pairs"] / ours["wall_s"], theirs["pairs"] / theirs["wall_s"]
    print(f"\nmonoT5 rerank (t5-small shape), {args.pairs} documents of 60 words:\n")
    print("| transformers pairs/s | embedserv pairs/s | speed-up | backend |")
    print("|---:|---:|---:|---|")
    print(f"| {theirs_rate:.0f} | {ours_rate:.0f} | {ours_rate / theirs_rate:.2f}x | {ours['note']} |")


if __name__ == "__main__":
    main()
