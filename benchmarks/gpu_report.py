"""gpu-check's benchmarks and its report (benchmarks/gpu_check.py runs them): embedding against
sentence-transformers, the bge-base shape's MFU at 512 tokens, and generation against transformers, each system
in a fresh process unless --in-process; one Markdown table, rewritten after every row.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

COLUMNS = ("task", "model", "dtype", "system", "work", "seconds", "texts/s", "tokens/s", "TTFT ms", "speed-up", "note")


class Report:
    """The header lines and the table's rows; rewritten to --out after every row, so a run cut short at the
    device's time limit still leaves what it measured."""

    def __init__(self, out: Path | None, header: list[str]) -> None:
        self.out, self.header, self.rows, self.failed = out, header, [], False

    def add(self, **row) -> None:
        self.rows.append(row)
        self.failed |= row.get("note", "").startswith("FAILED")
        print(
            f"gpu-check: {row['task']} / {row['model']} / {row['dtype']} / {row['system']} / {row['work']}: "
            f"{row.get('tokens/s', '')} tokens/s {row.get('note', '')}",
            file=sys.stderr,
            flush=True,
        )
        self.save()

    def render(self) -> str:
        lines = ["## embedserv gpu-check", "", *self.header, ""]
        lines.append("| " + " | ".join(COLUMNS) + " |")
        lines.append("|" + "|".join("---:" if c in COLUMNS[5:10] else "---" for c in COLUMNS) + "|")
        lines += ["| " + " | ".join(str(row.get(c, "")) for c in COLUMNS) + " |" for row in self.rows]
        return "\n".join(lines) + "\n"

    def save(self) -> None:
        if self.out:
            (self.out / "gpu-check.md").write_text(self.render())


def _failure(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("|", "/").replace("\n", " ")
    return "FAILED: " + (text[:200] + "..." if len(text) > 200 else text)


def _attempt(in_process: bool, fn, *args) -> dict:
    """fn(*args) in a fresh process (or this one); a failure becomes {"error": ...} so the others still run."""
    from benchmarks.embed_throughput import isolated

    try:
        return fn(*args) if in_process else isolated(fn, *args)
    except Exception as exc:
        return {"error": _failure(exc)}


def _rate(count: float, seconds: float) -> str:
    return f"{count / seconds:.0f}"


def bench_embedding(args, report: Report, name: str, model: Path, texts: list[str]) -> None:
    """sentence-transformers float16, then embedserv float16 and bfloat16, on the same texts."""
    from benchmarks import gpu_bench

    common = (args.device, args.batch_size, args.repeats)
    st = _attempt(args.in_process, gpu_bench.embed_sentence_transformers, str(model), texts, *common)
    ours = {
        dtype: _attempt(args.in_process, gpu_bench.embed_engine, str(model), texts, dtype, *common)
        for dtype in ("float16", "bfloat16")
    }
    tokens = next((r["tokens"] for r in ours.values() if "tokens" in r), None)
    work = f"{len(texts)} texts, {tokens} tokens" if tokens else f"{len(texts)} texts"
    results = [("float16", "sentence-transformers (.half())", st)] + [
        (dtype, "embedserv engine (in process)", r) for dtype, r in ours.items()
    ]
    for dtype, system, result in results:
        row = dict(task="embed", model=name, dtype=dtype, system=system, work=work)
        if "error" in result:
            report.add(**row, note=result["error"])
            continue
        seconds = result["seconds"]
        row.update(
            {
                "seconds": f"{seconds:.2f}",
                "texts/s": _rate(len(texts), seconds),
                "tokens/s": _rate(tokens, seconds) if tokens else "",
                "note": result.get("note", ""),
            }
        )
        if "seconds" in st:
            row["speed-up"] = f"{st['seconds'] / seconds:.2f}x"
        report.add(**row)


def bench_mfu(args, report: Report, name: str, model: Path, shape) -> None:
    """embedserv on 512-token inputs: achieved TFLOP/s and the share of the GPU's peak."""
    from benchmarks import gpu_bench

    for dtype in ("float16", "bfloat16"):
        result = _attempt(args.in_process, gpu_bench.embed_mfu, str(model), shape, dtype, args.device, args.repeats)
        row = dict(task="embed 512-token inputs", model=name, dtype=dtype, system="embedserv engine (in process)")
        if "error" in result:
            report.add(**row, note=result["error"])
            continue
        report.add(
            **row,
            work=f"256 texts, {result['tokens']} tokens",
            seconds=f"{result['seconds']:.2f}",
            **{"tokens/s": _rate(result["tokens"], result["seconds"])},
            note=result["note"],
        )


def bench_generation(args, report: Report, name: str, model: Path, streams: int) -> None:
    """transformers' batched generate, then embedserv, at `streams` concurrent greedy generations."""
    from benchmarks import gpu_bench

    common = (streams, args.max_tokens, args.gen_dtype, args.device, args.repeats)
    theirs = _attempt(args.in_process, gpu_bench.generate_transformers, str(model), *common)
    ours = _attempt(args.in_process, gpu_bench.generate_engine, str(model), *common)
    work = f"{streams} stream{'s' if streams > 1 else ''} x {args.max_tokens} tokens"
    for system, result in (("transformers generate (batched)", theirs), ("embedserv engine (in process)", ours)):
        row = dict(task="generate", model=name, dtype=args.gen_dtype, system=system, work=work)
        if "error" in result:
            report.add(**row, note=result["error"])
            continue
        row.update(
            {
                "seconds": f"{result['wall_s']:.2f}",
                "tokens/s": _rate(result["tokens"], result["wall_s"]),
                "TTFT ms": f"{result['ttft_s'] * 1e3:.0f}",
                "note": result.get("note", ""),
            }
        )
        if "error" not in theirs:
            theirs_rate = theirs["tokens"] / theirs["wall_s"]
            row["speed-up"] = f"{result['tokens'] / result['wall_s'] / theirs_rate:.2f}x"
        report.add(**row)


def run_benchmarks(args, model_dir: Path, report: Report) -> None:
    from benchmarks import gpu_bench
    from benchmarks.corpus import stdlib_texts

    if args.quick:
        bert_shape = gpu_bench.BertShape(hidden=128, layers=2, heads=2, intermediate=512)
        llama_shape = gpu_bench.LlamaShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384)
    else:
        bert_shape, llama_shape = gpu_bench.BertShape(), gpu_bench.LlamaShape()
    texts = stdlib_texts(args.texts)
    report.header.append(
        f"- work: {len(texts)} stdlib texts in calls / batches of {args.batch_size}; "
        f"generation prompts of 40-120 tokens, greedy, EOS ignored; each system "
        f"{'in this process' if args.in_process else 'in its own process'}, one untimed pass, "
        f"best of {args.repeats}; speed-up against the first row of its group"
    )
    chosen = set(args.bench.split(","))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if "embed" in chosen:
            bert = gpu_bench.build_bert(Path(tmp) / "bert", model_dir, bert_shape)
            bench_embedding(args, report, "all-MiniLM-L6-v2", model_dir, texts)
            bench_embedding(args, report, f"bge-base shape: {bert_shape.describe()}", bert, texts)
            bench_mfu(args, report, f"bge-base shape: {bert_shape.describe()}", bert, bert_shape)
        if "generate" in chosen:
            llama = gpu_bench.build_llama(Path(tmp) / "llama", model_dir, llama_shape)
            for streams in args.streams:
                bench_generation(args, report, llama_shape.describe(), llama, streams)
