"""Reranking throughput (pairs/s): sentence-transformers vs our engine, same run, same pairs.

    python benchmarks/rerank_throughput.py [--queries 10] [--documents 100] [--dtypes float32,bfloat16]

Two workloads on real texts (stdlib docstrings as documents, their opening words as queries):
- cross-encoder: a random-weight BertForSequenceClassification of cross-encoder/ms-marco-MiniLM-L6-v2's
  shape (6 layers, hidden 384, 512-token limit), built here: CrossEncoder.predict per query against
  Engine.rerank per query (one call at a time, as the reference is used) and all queries at once
  (concurrent calls, as a server sees them).
- bi-encoder: the bundled all-MiniLM-L6-v2; sentence-transformers encode_query + encode_document +
  cos_sim per query against Engine.rerank per query.
Documents longer than the limit are truncated by both. Each system runs in a process of its own, gets one
untimed pass, then --repeats timed passes; the fastest counts. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.corpus import stdlib_texts  # noqa: E402
from benchmarks.embed_throughput import best_of, isolated  # noqa: E402
from embedserv import cpu_isa  # noqa: E402
from embedserv.config import ModelConfig, bundled_model_path  # noqa: E402
from embedserv.engine.sync import SyncEngine  # noqa: E402
from embedserv.types import RerankParams  # noqa: E402


def build_minilm_cross_encoder(out: Path) -> Path:
    """Random weights in ms-marco-MiniLM-L6-v2's shape with the bundled tokenizer (nothing downloaded)."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_path()))
    tokenizer.model_max_length = 512
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
        intermediate_size=1536, max_position_embeddings=512, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_dir = out / "hf"
    BertForSequenceClassification(config).eval().save_pretrained(str(hf_dir))
    tokenizer.save_pretrained(str(hf_dir))
    CrossEncoder(str(hf_dir), device="cpu").save(str(out / "ce"), create_model_card=False)
    return out / "ce"


def workload(num_queries: int, num_documents: int) -> tuple[list[str], list[str]]:
    queries = [" ".join(t.split()[:8]) for t in stdlib_texts(num_queries, seed=21)]
    return queries, stdlib_texts(num_documents, seed=22)


def bench_cross_encoder(model: str, queries, documents, dtype: str, repeats: int) -> float:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(model, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    return best_of(repeats, lambda: [reference.predict([(q, d) for d in documents], batch_size=32) for q in queries])[0]


def bench_bi_encoder(model: str, queries, documents, dtype: str, repeats: int) -> float:
    from sentence_transformers import SentenceTransformer, util

    st = SentenceTransformer(model, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})

    def run():
        return [util.cos_sim(st.encode_query(q), st.encode_document(documents, batch_size=32)) for q in queries]

    return best_of(repeats, run)[0]


def bench_engine(model: str, queries, documents, dtype: str, repeats: int, concurrent: bool) -> float:
    params = RerankParams(truncate=True)
    with SyncEngine(ModelConfig(path=model, served_name="bench", dtype=dtype)) as engine:
        if concurrent:
            calls = [(q, documents) for q in queries]
            return best_of(repeats, lambda: engine.rerank_concurrently(calls, params))[0]
        return best_of(repeats, lambda: [engine.rerank(q, documents, params) for q in queries])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    queries, documents = workload(args.queries, args.documents)
    pairs = len(queries) * len(documents)
    print(
        f"# {cpu_isa.detect().summary()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {len(queries)} queries x {len(documents)} documents = {pairs} pairs"
    )
    print("| model | dtype | system | seconds | pairs/s | vs sentence-transformers |")
    print("|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        cross = str(build_minilm_cross_encoder(Path(tmp)))
        bundled = str(bundled_model_path())
        for label, model, reference in (
            ("cross-encoder (MiniLM-L6 shape)", cross, bench_cross_encoder),
            ("bi-encoder all-MiniLM-L6-v2", bundled, bench_bi_encoder),
        ):
            for dtype in args.dtypes.split(","):
                base = isolated(reference, model, queries, documents, dtype, args.repeats)
                rows = [("sentence-transformers", base)]
                rows.append(
                    (
                        "embedserv, one call at a time",
                        isolated(bench_engine, model, queries, documents, dtype, args.repeats, False),
                    )
                )
                rows.append(
                    (
                        f"embedserv, {len(queries)} concurrent calls",
                        isolated(bench_engine, model, queries, documents, dtype, args.repeats, True),
                    )
                )
                for system, seconds in rows:
                    print(
                        f"| {label} | {dtype} | {system} | {seconds:.2f} | {pairs / seconds:.0f} | "
                        f"{base / seconds:.2f}x |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
