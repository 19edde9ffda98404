"""Driver side: the results table, the correctness numbers and the header line of benchmarks/peers.py."""

from __future__ import annotations

from dataclasses import dataclass

from .common import ISA_FLAGS

REFERENCE = ("st-torch", "fp32")
OURS = "embedserv-grpc"
# Below this mean cosine against the reference a row is flagged (bf16 and int8 rows are expected lower).
MIN_MEAN_COSINE = 0.99
COLUMNS = ("peer", "precision", "texts/s", "tokens/s", "vs st-torch fp32", "vs embedserv-grpc", "p50 ms",
           "p99 ms", "min cos", "mean cos", "notes")  # fmt: skip


@dataclass
class Row:
    """One (peer, precision): its best pass's seconds (None when skipped or failed), latencies for servers,
    cosines against the reference, and notes (how it ran, or why it did not)."""

    peer: str
    precision: str
    seconds: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    cos_min: float | None = None
    cos_mean: float | None = None
    notes: str = ""


def cosines(reference, vectors) -> tuple[float, float]:
    """Min and mean cosine similarity of each row of `vectors` with the same row of `reference`."""
    import numpy as np

    a = np.asarray(reference, dtype=np.float64)
    b = np.asarray(vectors, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"vectors of shape {b.shape}, the reference's are {a.shape}")
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    cos = (a * b).sum(axis=1) / norms
    return float(cos.min()), float(cos.mean())


def _number(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _ratio(seconds: float | None, base: float | None) -> str:
    return "" if seconds is None or base is None else f"{base / seconds:.2f}x"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " / ")


def render_table(rows: list[Row], num_texts: int, num_tokens: int) -> str:
    """The markdown table: throughput, ratios (speed-ups: above 1x is faster than the base), latency, cosines."""
    seconds = {(row.peer, row.precision): row.seconds for row in rows}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 3) + "---|"]
    for row in rows:
        notes = row.notes
        if row.cos_mean is not None and row.cos_mean < MIN_MEAN_COSINE:
            notes = f"**mean cosine < {MIN_MEAN_COSINE}**; {notes}"
        throughput = [] if row.seconds is None else [num_texts / row.seconds, num_tokens / row.seconds]
        cells = [
            row.peer,
            row.precision,
            _number(throughput[0], 1) if throughput else "",
            _number(throughput[1], 0) if throughput else "",
            _ratio(row.seconds, seconds.get(REFERENCE)),
            _ratio(row.seconds, seconds.get((OURS, row.precision))),
            _number(row.p50_ms, 1),
            _number(row.p99_ms, 1),
            _number(row.cos_min, 5),
            _number(row.cos_mean, 5),
            _cell(notes),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def isa_summary(flags: frozenset[str]) -> str:
    return " ".join(flag for flag in ISA_FLAGS if flag in flags) or "none of " + "/".join(ISA_FLAGS)


def render_header(facts: dict) -> str:
    """The lines above the table: what ran where. `facts` holds the keys used below."""
    versions = "; ".join(f"{venv}: " + ", ".join(f"{name} {version}" for name, version in found.items())
                         for venv, found in facts["versions"].items())  # fmt: skip
    return "\n".join([
        f"# Embedding peers: {facts['model']}, embedserv {facts['commit']}, {facts['date']}",
        "",
        f"CPU: {facts['cpu']}; ISA: {isa_summary(facts['flags'])}; {facts['cores']} cores, "
        f"{facts['threads']} threads per peer.",
        f"Texts: {facts['texts']} (benchmarks/corpus.py stdlib_texts), mean {facts['mean_tokens']:.1f} tokens "
        f"({facts['tokens']} in all: truncated at {facts['max_seq_length']}, special tokens included, the same "
        f"count for every peer); best of {facts['repeats']} passes after a warm-up over {facts['warmup']} texts.",
        f"In process: batches of {facts['batch_size']} (vLLM: all texts in one embed() call). Servers: "
        f"{facts['batch_size']} texts per request, {facts['concurrency']} in flight; latency over "
        f"{facts['latency_requests']} one-text requests in sequence. Cosines against st-torch fp32.",
        f"Versions: {versions}.",
    ])  # fmt: skip


# How the performance page (benchmarks/performance_page.py) names each peer.
SYSTEMS = {
    "st-torch": "sentence-transformers (torch)",
    "st-onnx": "sentence-transformers (ONNX Runtime)",
    "st-openvino": "sentence-transformers (OpenVINO)",
    "vllm-offline": "vLLM CPU, offline LLM.embed",
    "vllm-server": "vLLM CPU, OpenAI server",
    "infinity-torch": "Infinity (torch engine)",
    "infinity-onnx": "Infinity (ONNX engine)",
    "embedserv-grpc": "embedserv gRPC",
    "embedserv-http": "embedserv HTTP",
}


def cpu_class(flags: frozenset[str]) -> str:
    """The CPU class a run's figures hold for (the performance page's sections)."""
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX-512 + bf16 + VNNI" if {"avx512_bf16", "avx512_vnni"} <= flags else "AVX-512"
    return "AVX2"


def results_file(rows: list[Row], facts: dict, title: str, command: str, setup: str) -> dict:
    """The run as benchmarks/results/*.json holds it for the performance page: the rows that ran, in tokens/s."""
    return {
        "title": title,
        "cpu_class": cpu_class(facts["flags"]),
        "cpu": f"{facts['cpu']}, {isa_summary(facts['flags'])}, {facts['cores']} cores",
        "date": facts["date"][:10],
        "commit": facts["commit"],
        "command": command,
        "setup": setup,
        "texts": facts["texts"],
        "tokens": facts["tokens"],
        "source": "written by benchmarks/peers.py",
        "rows": [
            {"system": SYSTEMS.get(row.peer, row.peer), "precision": row.precision,
             "tokens_per_s": round(facts["tokens"] / row.seconds),
             **({"min_cos": round(row.cos_min, 5)} if row.cos_min is not None else {})}
            for row in rows if row.seconds is not None
        ],
    }  # fmt: skip
