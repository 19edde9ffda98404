"""Late chunking against today's alternatives on ~4k-token documents, in process, on a random long-context
model shaped like a small ModernBERT (6 layers of 384, every third layer global, the others a 128-token window,
8,192 positions; mean pooling). A benchmark, not a test: it prints one table.

    python benchmarks/late_chunking.py [--docs 4] [--repeats 2] [--chunk-tokens 256] [--cache DIR]

Rows (every document cut into chunks of --chunk-tokens tokens; the same chunks for every row that has them):
- late chunking: one pass over each whole document, one vector per chunk (CHUNK_SPLITTER_TOKENS).
- late chunking, 2k context: the same model told its context is 2,048 tokens, so each document runs as
  overlapping windows (a quarter shared): what a long document costs past a model's context.
- chunk-and-pool (CHUNKING_MEAN): one vector per document, the mean of its windows; a 4k document fits the
  8k context, so it is one pass and no chunk vectors.
- chunks embedded alone: every chunk's text as its own input (the usual pipeline; no cross-chunk context).

Best of --repeats timed passes after a warm-up pass. docs/s counts documents, chunks/s the chunk vectors made.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.corpus import stdlib_texts
from benchmarks.peer_models import BERT_INIT_STD, Shape, build_random_model

SHAPE = Shape("modernbert", dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=576,
                                 global_attn_every_n_layers=3, local_attention=128, max_position_embeddings=8192,
                                 initializer_range=BERT_INIT_STD), "mean", 8192)  # fmt: skip
DOC_TOKENS = 4000
SHORT_CONTEXT = 2048


def model_dirs(cache: Path) -> tuple[Path, Path]:
    """The model, and a copy of its files that declares a 2,048-token context."""
    full = cache / "late-chunking-modernbert-small"
    if not (full / "modules.json").exists():
        build_random_model(SHAPE, full)
    short = cache / "late-chunking-modernbert-small-2k"
    if not short.exists():
        shutil.copytree(full, short)
        config = json.loads((short / "sentence_bert_config.json").read_text())
        (short / "sentence_bert_config.json").write_text(json.dumps({**config, "max_seq_length": SHORT_CONTEXT}))
    return full, short


def documents(tokenizer, count: int) -> list[str]:
    """`count` real-text documents of about DOC_TOKENS word-pieces each (texts joined by blank lines)."""
    pool, docs = iter(stdlib_texts(count * 200, seed=7)), []
    while len(docs) < count:
        text = ""
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < DOC_TOKENS:
            text += next(pool) + "\n\n"
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        docs.append(text[: offsets[DOC_TOKENS - 1][1]])
    return docs


def timed(run, repeats: int) -> tuple[float, object]:
    result = run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "embedserv-bench")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine
    from embedserv.types import ChunkSplitter, EmbedParams, LateChunking

    full, short = model_dirs(args.cache)
    docs = documents(AutoTokenizer.from_pretrained(str(full)), args.docs)
    late = EmbedParams(late_chunking=LateChunking(ChunkSplitter.TOKENS, chunk_tokens=args.chunk_tokens))
    rows = []
    with SyncEngine(ModelConfig(path=str(full), served_name="m", dtype="float32")) as engine:
        seconds, result = timed(lambda: engine.embed(docs, late), args.repeats)
        spans = [s for s, _ in result.chunks]
        chunks = sum(map(len, spans))
        rows.append(("late chunking", seconds, chunks, result.prompt_tokens))
        seconds, result = timed(lambda: engine.embed(docs, EmbedParams(chunking=True)), args.repeats)
        rows.append(("chunk-and-pool (CHUNKING_MEAN)", seconds, 0, result.prompt_tokens))
        pieces = [doc[start:end] for doc, doc_spans in zip(docs, spans, strict=True) for start, end in doc_spans]
        seconds, result = timed(lambda: engine.embed(pieces, EmbedParams()), args.repeats)
        rows.append(("chunks embedded alone", seconds, len(pieces), result.prompt_tokens))
    with SyncEngine(ModelConfig(path=str(short), served_name="m", dtype="float32")) as engine:
        seconds, result = timed(lambda: engine.embed(docs, late), args.repeats)
        name = f"late chunking, {SHORT_CONTEXT // 1024}k context (windows)"
        rows.append((name, seconds, chunks, result.prompt_tokens))

    print(f"{len(docs)} documents of {DOC_TOKENS} word-pieces, chunks of {args.chunk_tokens} tokens, "
          f"best of {args.repeats}")  # fmt: skip
    print(f"| {'mode':<40} | {'docs/s':>7} | {'chunks/s':>8} | {'tokens run':>10} |")
    print(f"|{'-' * 42}|{'-' * 9}|{'-' * 10}|{'-' * 12}|")
    for name, seconds, made, tokens in rows:
        chunk_rate = f"{made / seconds:8.1f}" if made else f"{'-':>8}"
        print(f"| {name:<40} | {len(docs) / seconds:7.2f} | {chunk_rate} | {tokens:>10} |")


if __name__ == "__main__":
    main()
