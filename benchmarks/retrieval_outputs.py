"""Throughput of the retrieval outputs (texts/s): sparse, multi-vector and bge-m3's three outputs, our engine
against the sentence-transformers encoders (and, for bge-m3, transformers with its heads), same run, same
texts; then bytes per vector per encoding.

    python benchmarks/retrieval_outputs.py [--texts 512] [--repeats 3] [--batch-size 32]

Models (random weights in MiniLM-L6's shape, 6 layers, hidden 384, with the bundled tokenizer; nothing
downloaded), built here:
- sparse: a BertForMaskedLM saved as a sentence-transformers SparseEncoder (SpladePooling max, relu) —
  SparseEncoder.encode against Engine.embed(outputs=SPARSE) (what EmbedSparse runs);
- multi-vector: a BertModel with a token-level Dense(384 -> 128) and Normalize saved as a MultiVectorEncoder
  — MultiVectorEncoder.encode_document against Engine.embed(outputs=MULTI_VECTOR, prompt_name="document");
- bge-m3-shaped: an XLMRobertaModel with CLS pooling + Normalize and the sparse_linear / colbert_linear heads
  — one transformers forward with the three heads computed in torch (the FlagEmbedding formulas; what a
  user without a server runs) against one Engine.embed asking for all three outputs, and against three
  separate Engine.embed calls (one per output).
Every system runs in a process of its own, one untimed pass, then --repeats timed passes; the fastest
counts. Texts are real (stdlib docstrings), truncated at the model's 256-token limit by every system.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.corpus import stdlib_texts  # noqa: E402
from benchmarks.embed_throughput import best_of, isolated  # noqa: E402
from embedserv.config import ModelConfig, bundled_model_path  # noqa: E402
from embedserv.types import EmbedOutput, EmbedParams, Encoding  # noqa: E402

MAX_TOKENS = 256
SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)


def _tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_path()))
    tokenizer.model_max_length = MAX_TOKENS
    return tokenizer


def build_models(root: Path) -> dict[str, Path]:
    from sentence_transformers import MultiVectorEncoder, SentenceTransformer, SparseEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from sentence_transformers.sentence_transformer.modules import Pooling
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import BertConfig, BertForMaskedLM, BertModel, XLMRobertaConfig, XLMRobertaModel

    tokenizer = _tokenizer()
    torch.manual_seed(0)
    bert = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **SHAPE)
    paths = {}
    for name, model in (("mlm", BertForMaskedLM(bert)), ("bert", BertModel(bert, add_pooling_layer=False))):
        model.save_pretrained(str(root / name))
        tokenizer.save_pretrained(str(root / name))
    SparseEncoder(modules=[Transformer(str(root / "mlm"), transformer_task="fill-mask"), SpladePooling("max")]).save(
        str(root / "sparse")
    )
    paths["sparse"] = root / "sparse"
    dense = Dense(
        384,
        128,
        bias=False,
        activation_function=torch.nn.Identity(),
        module_input_name="token_embeddings",
        module_output_name="token_embeddings",
    )
    MultiVectorEncoder(modules=[Transformer(str(root / "bert")), dense, Normalize(), MultiVectorMask()]).save(
        str(root / "multi_vector")
    )
    paths["multi_vector"] = root / "multi_vector"
    xlmr = XLMRobertaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=MAX_TOKENS + 2, pad_token_id=tokenizer.pad_token_id, **SHAPE
    )
    XLMRobertaModel(xlmr, add_pooling_layer=False).save_pretrained(str(root / "xlmr"))
    tokenizer.save_pretrained(str(root / "xlmr"))
    m3 = root / "bge_m3"
    SentenceTransformer(modules=[Transformer(str(root / "xlmr")), Pooling(384, pooling_mode="cls"), Normalize()]).save(
        str(m3)
    )
    torch.save(torch.nn.Linear(384, 1).state_dict(), m3 / "sparse_linear.pt")
    torch.save(torch.nn.Linear(384, 384).state_dict(), m3 / "colbert_linear.pt")
    paths["bge_m3"] = m3
    return paths


def st_sparse(model: str, texts: list[str], batch_size: int, repeats: int) -> float:
    from sentence_transformers import SparseEncoder

    encoder = SparseEncoder(model, device="cpu")
    return best_of(repeats, lambda: encoder.encode(texts, batch_size=batch_size))[0]


def st_multi_vector(model: str, texts: list[str], batch_size: int, repeats: int) -> float:
    from sentence_transformers import MultiVectorEncoder

    encoder = MultiVectorEncoder(model, device="cpu")
    return best_of(repeats, lambda: encoder.encode_document(texts, batch_size=batch_size))[0]


def transformers_bge_m3(model: str, texts: list[str], batch_size: int, repeats: int) -> float:
    """One forward per batch and the three heads as FlagEmbedding computes them."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    encoder = AutoModel.from_pretrained(model).eval()
    sparse, colbert = torch.nn.Linear(384, 1), torch.nn.Linear(384, 384)
    sparse.load_state_dict(torch.load(Path(model) / "sparse_linear.pt", weights_only=True))
    colbert.load_state_dict(torch.load(Path(model) / "colbert_linear.pt", weights_only=True))
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)))

    @torch.inference_mode()
    def run():
        out = []
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start : start + batch_size], padding=True, truncation=True, return_tensors="pt")
            hidden = encoder(**batch).last_hidden_state
            dense = torch.nn.functional.normalize(hidden[:, 0], dim=-1)
            weights = torch.relu(sparse(hidden)).squeeze(-1) * batch["attention_mask"]
            weights = weights.masked_fill(torch.isin(batch["input_ids"], special), 0)
            lexical = []
            for ids, w in zip(batch["input_ids"].tolist(), weights.tolist(), strict=True):
                row: dict[int, float] = {}
                for i, v in zip(ids, w, strict=True):
                    if v > 0 and v > row.get(i, 0.0):
                        row[i] = v
                lexical.append(row)
            vectors = torch.nn.functional.normalize(colbert(hidden[:, 1:]), dim=-1)
            lengths = batch["attention_mask"].sum(1).tolist()
            out.append((dense, lexical, [v[: n - 1] for v, n in zip(vectors, lengths, strict=True)]))
        return out

    return best_of(repeats, run)[0]


def engine_outputs(model: str, texts: list[str], batch_size: int, repeats: int, calls: list[dict]) -> float:
    """Each of `calls` (EmbedParams fields) over every batch of texts, all batches concurrently."""
    from embedserv.engine.sync import SyncEngine

    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    with SyncEngine(ModelConfig(path=model, served_name="bench", allow_pickle=True)) as engine:

        def run():
            for fields in calls:
                engine.embed_concurrently(batches, EmbedParams(truncate=True, **fields))

        return best_of(repeats, run)[0]


def encoding_sizes(dimension: int) -> list[tuple[str, int]]:
    from embedserv.engine.tasks.quantize import encode

    vector = np.random.default_rng(0).standard_normal((1, dimension)).astype(np.float32)
    ranges = np.vstack((np.full(dimension, -3.0), np.full(dimension, 3.0))).astype(np.float32)
    return [(str(e), encode(vector, e, ranges).nbytes) for e in Encoding]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    texts = stdlib_texts(args.texts, seed=1)
    sparse, multi = (EmbedOutput.SPARSE,), (EmbedOutput.MULTI_VECTOR,)
    three = (EmbedOutput.DENSE, EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: str(path) for name, path in build_models(Path(tmp)).items()}
        bs, n = args.batch_size, args.repeats
        rows = [
            (
                "sparse (SPLADE max)",
                "SparseEncoder.encode",
                isolated(st_sparse, paths["sparse"], texts, bs, n),
                isolated(engine_outputs, paths["sparse"], texts, bs, n, [dict(outputs=sparse)]),
            ),
            (
                "multi-vector (token Dense 128)",
                "MultiVectorEncoder.encode_document",
                isolated(st_multi_vector, paths["multi_vector"], texts, bs, n),
                isolated(
                    engine_outputs, paths["multi_vector"], texts, bs, n, [dict(outputs=multi, prompt_name="document")]
                ),
            ),
            (
                "bge-m3-shaped, 3 outputs in one call",
                "transformers + heads, one forward",
                isolated(transformers_bge_m3, paths["bge_m3"], texts, bs, n),
                isolated(engine_outputs, paths["bge_m3"], texts, bs, n, [dict(outputs=three)]),
            ),
            (
                "bge-m3-shaped, 3 calls (one per output)",
                "transformers + heads, one forward",
                None,
                isolated(engine_outputs, paths["bge_m3"], texts, bs, n, [dict(outputs=(o,)) for o in three]),
            ),
        ]
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    print(
        f"\n{len(texts)} texts, batch {args.batch_size}, best of {args.repeats}; {cpu}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}, Python {platform.python_version()}\n"
    )
    print("| Output | Reference | Reference texts/s | embedserv texts/s | ratio |")
    print("|---|---|---|---|---|")
    reference_m3 = rows[2][2]
    for name, reference, ref_s, ours_s in rows:
        ref_s = ref_s if ref_s is not None else reference_m3
        print(
            f"| {name} | {reference} | {len(texts) / ref_s:.0f} | {len(texts) / ours_s:.0f} | {ref_s / ours_s:.2f}x |"
        )
    print("\n| Encoding | bytes per 384-dim vector | bytes per 1024-dim vector |")
    print("|---|---|---|")
    for (name, small), (_, large) in zip(encoding_sizes(384), encoding_sizes(1024), strict=True):
        print(f"| {name} | {small} | {large} |")


if __name__ == "__main__":
    main()
