"""Generation: decode tokens/s and time to first token at 1, 8 and 32 concurrent streams, against
transformers' generate with the same batch sizes, same run, same prompts.

    python benchmarks/generate_throughput.py [--streams 1,8,32] [--max-tokens 64] [--dtypes float32]
        [--attention sdpa,cpu_varlen]

The model is a random-weight Llama in SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads,
tied embeddings) with the bundled tokenizer's 30k vocabulary, built here (nothing downloaded). Prompts are
real texts of 40 to 120 tokens; every stream generates exactly --max-tokens tokens (EOS ignored).
- embedserv: N generations submitted at once to the engine (continuous batching over the paged KV cache).
- transformers: one `generate` call on the N prompts, left-padded, greedy, `min_new_tokens` = max.
Time to first token: from submission to the first generated token (a streamer's second `put` for
transformers, which sees the whole batch's first token at once). Output tokens/s: all generated tokens
over the wall time of the run, prefill included. Each system runs in its own process: one untimed pass,
then --repeats timed passes; the fastest counts. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
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
from embedserv.config import ModelConfig, bundled_model_path  # noqa: E402

# SmolLM2-135M's shape.
SMOL_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3)  # fmt: skip


def build_model(out: Path, shape: dict | None = None) -> Path:
    """A random-weight Llama of `shape` (LlamaConfig fields; SmolLM2-135M's by default) with the bundled
    tokenizer, saved to `out`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_path()))
    tokenizer.model_max_length = 2048
    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=101, eos_token_id=102, **(shape or SMOL_SHAPE),
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def prompts(count: int) -> list[str]:
    texts = stdlib_texts(count, seed=31)
    return [" ".join(t.split()[: 30 + (i * 7) % 60]) for i, t in enumerate(texts)]


def _timed(run, repeats: int) -> dict:
    run()
    results = [run() for _ in range(repeats)]
    return min(results, key=lambda r: r["wall_s"])


def bench_engine(
    model: str, streams: int, max_tokens: int, dtype: str, repeats: int, device: str = "cpu", attention=None
) -> dict:
    """The fastest timed pass; `note` names the attention backend the engine ran (`attention`, else its pick)."""
    from embedserv.engine.sync import SyncEngine
    from embedserv.types import SamplingParams

    texts = prompts(streams)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * streams
    config = ModelConfig(
        path=model, served_name="m", device=device, dtype=dtype, kv_cache_memory=2**30, attention_backend=attention
    )
    with SyncEngine(config) as engine:

        def run() -> dict:
            first: dict[int, float] = {}
            start = time.perf_counter()

            def on_delta(index, delta):
                first.setdefault(index, time.perf_counter() - start)

            results = engine.generate_concurrently(texts, params, on_delta=on_delta)
            wall = time.perf_counter() - start
            tokens = sum(len(d.token_ids) for r in results for d in r)
            assert tokens == streams * max_tokens, tokens
            return {"wall_s": wall, "tokens": tokens, "ttft_s": statistics.mean(first.values())}

        return dict(_timed(run, repeats), note=engine.info.attention_backend)


def bench_transformers(
    model: str, streams: int, max_tokens: int, dtype: str, repeats: int, device: str = "cpu"
) -> dict:
    """transformers' generate on the same prompts as one left-padded batch, greedy, exactly max_tokens new
    tokens per stream. Time to first token: the batch's first token (the streamer's second `put`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    batch = tokenizer(prompts(streams), return_tensors="pt", padding=True, return_token_type_ids=False).to(device)

    class FirstToken(BaseStreamer):
        def __init__(self, start: float) -> None:
            self.start, self.puts, self.first = start, 0, None

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:  # the first put is the prompt; .cpu() waits for the token
                value.cpu()
                self.first = time.perf_counter() - self.start

        def end(self) -> None:
            pass

    def run() -> dict:
        start = time.perf_counter()
        streamer = FirstToken(start)
        with torch.inference_mode():
            out = lm.generate(
                **batch,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                streamer=streamer,
                pad_token_id=tokenizer.pad_token_id,
            )
            out = out.cpu()
        wall = time.perf_counter() - start
        tokens = (out.shape[1] - batch["input_ids"].shape[1]) * streams
        return {"wall_s": wall, "tokens": tokens, "ttft_s": streamer.first}

    return _timed(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--attention", default="", help="embedserv's attention backends, a row each; empty: its pick")
    args = parser.parse_args()
    backends = args.attention.split(",") if args.attention else [None]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "smol-llama"))
        for dtype in args.dtypes.split(","):
            for streams in [int(s) for s in args.streams.split(",")]:
                theirs = isolated(bench_transformers, model, streams, args.max_tokens, dtype, args.repeats)
                for backend in backends:
                    ours = isolated(bench_engine, model, streams, args.max_tokens, dtype, args.repeats, "cpu", backend)
                    rows.append((dtype, streams, ours, theirs))
                print(f"done {dtype} x{streams}", file=sys.stderr, flush=True)

    print(f"\n{cpu_isa.detect().summary()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{args.max_tokens} new tokens per stream; best of {args.repeats}\n")
    print(
        "| dtype | streams | attention | transformers tok/s | embedserv tok/s | speed-up | transformers TTFT ms "
        "| embedserv TTFT ms |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for dtype, streams, ours, theirs in rows:
        ours_rate, theirs_rate = ours["tokens"] / ours["wall_s"], theirs["tokens"] / theirs["wall_s"]
        print(
            f"| {dtype} | {streams} | {ours['note']} | {theirs_rate:.0f} | {ours_rate:.0f} "
            f"| {ours_rate / theirs_rate:.2f}x | {theirs['ttft_s'] * 1e3:.0f} | {ours['ttft_s'] * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
