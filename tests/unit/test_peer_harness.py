"""The pure pieces of benchmarks/peers.py: the random models it builds, the cosine check, the results table and
the run plan. No peer venv is needed; the models here are small versions of the benchmark shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.peer_models import SHAPES, Shape, build_random_model, max_seq_length, pooling_mode
from benchmarks.peer_runners.common import ort_int8_config, percentile
from benchmarks.peer_runners.report import Row, cosines, render_table
from benchmarks.peer_runners.server_client import latency_texts
from benchmarks.peers import plan

TINY = {
    "bert": Shape("bert", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               initializer_range=0.1), "cls", 128),
    "qwen3": Shape("qwen3", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=32, intermediate_size=128, max_position_embeddings=1024,
                                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
                   "lasttoken", 128),
    "modernbert": Shape("modernbert", dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                           intermediate_size=96, global_attn_every_n_layers=3, local_attention=16,
                                           max_position_embeddings=1024, initializer_range=0.1), "mean", 128),
    "mpnet": Shape("mpnet", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 max_position_embeddings=514, initializer_range=0.1), "mean", 128),
}  # fmt: skip


def test_shapes_are_the_published_configs():
    bge_base, bge_large, qwen3 = SHAPES["bge-base"], SHAPES["bge-large"], SHAPES["qwen3-0.6b"]
    assert (
        bge_base.config["hidden_size"],
        bge_base.config["num_hidden_layers"],
        bge_base.config["num_attention_heads"],
        bge_base.config["intermediate_size"],
    ) == (768, 12, 12, 3072)
    assert (
        bge_large.config["hidden_size"],
        bge_large.config["num_hidden_layers"],
        bge_large.config["num_attention_heads"],
        bge_large.config["intermediate_size"],
    ) == (1024, 24, 16, 4096)
    assert {k: qwen3.config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "intermediate_size")} == {
        "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072}  # fmt: skip
    assert (bge_base.pooling, bge_large.pooling, qwen3.pooling) == ("cls", "cls", "lasttoken")
    assert {shape.max_seq_length for shape in (bge_base, bge_large, qwen3)} == {512}
    # modernbert-embed-base and all-mpnet-base-v2.
    modernbert, mpnet = SHAPES["modernbert-base"], SHAPES["mpnet-base"]
    assert {k: modernbert.config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "intermediate_size", "global_attn_every_n_layers", "local_attention",
                                               "max_position_embeddings")} == {
        "hidden_size": 768, "num_hidden_layers": 22, "num_attention_heads": 12, "intermediate_size": 1152,
        "global_attn_every_n_layers": 3, "local_attention": 128, "max_position_embeddings": 8192}  # fmt: skip
    assert (
        mpnet.config["hidden_size"],
        mpnet.config["num_hidden_layers"],
        mpnet.config["num_attention_heads"],
        mpnet.config["intermediate_size"],
    ) == (768, 12, 12, 3072)
    assert (modernbert.pooling, modernbert.max_seq_length, mpnet.pooling, mpnet.max_seq_length) == (
        "mean",
        512,
        "mean",
        384,
    )


@pytest.mark.parametrize("arch", sorted(TINY))
def test_built_model_is_a_loadable_sentence_transformer_of_its_shape(tmp_path, arch):
    from sentence_transformers import SentenceTransformer

    shape = TINY[arch]
    out = build_random_model(shape, tmp_path / arch)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    assert {key: config[key] for key in shape.config if key != "rope_theta"} == {
        key: value for key, value in shape.config.items() if key != "rope_theta"}  # fmt: skip
    if arch == "qwen3":
        # transformers 4.x reads only the top-level rope_theta; vLLM needs a registered architecture.
        assert config["rope_theta"] == 1_000_000.0 and "rope_parameters" not in config
        assert config["architectures"] == ["Qwen3ForCausalLM"]
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert pooling_mode(out) == shape.pooling
    assert max_seq_length(out) == shape.max_seq_length
    assert not (tmp_path / f"{arch}.partial").exists()

    model = SentenceTransformer(str(out), device="cpu")
    vectors = model.encode(["a short text", "another, longer text about something else entirely", "x"])
    assert vectors.shape == (3, shape.config["hidden_size"])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    similarity = vectors @ vectors.T
    assert similarity[np.triu_indices(3, 1)].max() < 0.999, "random vectors of different texts should differ"


def test_cosines_min_and_mean():
    reference = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    same, _ = cosines(reference, reference * 5)
    assert same == pytest.approx(1.0)
    vectors = np.array([[1.0, 1.0], [0.0, 1.0], [-3.0, -4.0]])
    low, mean = cosines(reference, vectors)
    assert low == pytest.approx(-1.0)
    assert mean == pytest.approx((2**-0.5 + 1.0 - 1.0) / 3)
    with pytest.raises(ValueError, match="shape"):
        cosines(reference, reference[:2])


def test_table_ratios_latency_flags_and_failures():
    rows = [
        Row("st-torch", "fp32", seconds=10.0, cos_min=1.0, cos_mean=1.0, notes="encode(batch_size=32)"),
        Row("embedserv-grpc", "fp32", seconds=4.0, p50_ms=12.345, p99_ms=40.0, cos_min=0.99999, cos_mean=0.999995),
        Row("embedserv-grpc", "int8", seconds=2.0, p50_ms=9.0, p99_ms=20.0, cos_min=0.95, cos_mean=0.98),
        Row("st-onnx", "int8", seconds=8.0, cos_min=0.97, cos_mean=0.985),
        Row("vllm-server", "fp32", notes="failed: PeerError: exit code 1: a | b\nc"),
    ]
    lines = render_table(rows, num_texts=100, num_tokens=5000).splitlines()
    assert lines[0].startswith("| peer | precision | texts/s | tokens/s | vs st-torch fp32 | vs embedserv-grpc |")
    cells = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]
    assert cells[0][:6] == ["st-torch", "fp32", "10.0", "500", "1.00x", "0.40x"]
    assert cells[1][2:10] == ["25.0", "1250", "2.50x", "1.00x", "12.3", "40.0", "0.99999", "0.99999"]
    # Ratios against embedserv-grpc are taken at the row's own precision.
    assert cells[3][4:6] == ["1.25x", "0.25x"]
    assert cells[2][10].startswith("**mean cosine < 0.99**") and cells[3][10].startswith("**mean cosine < 0.99**")
    assert "mean cosine" not in cells[1][10]
    # A failed row: no numbers, its reason in one cell (pipes escaped, lines joined).
    assert lines[6].count(" | ") == 10
    assert cells[4][2:10] == [""] * 8
    assert "a \\| b / c" in lines[6]


def test_plan_runs_the_reference_first_once_and_only_supported_precisions():
    names = [(peer.name, precision) for peer, precision in plan(["embedserv-grpc", "st-torch", "st-onnx"],
                                                                  ("fp32", "bf16", "int8"))]  # fmt: skip
    assert names == [
        ("st-torch", "fp32"),
        ("embedserv-grpc", "fp32"),
        ("embedserv-grpc", "bf16"),
        ("embedserv-grpc", "int8"),
        ("st-torch", "bf16"),
        ("st-onnx", "fp32"),
        ("st-onnx", "int8"),
    ]
    assert [(p.name, q) for p, q in plan(["infinity-onnx"], ("bf16",))] == [("st-torch", "fp32")]


def test_small_helpers():
    assert ort_int8_config(frozenset({"avx2"})) == "avx2"
    assert ort_int8_config(frozenset({"avx2", "avx512f"})) == "avx512"
    assert ort_int8_config(frozenset({"avx2", "avx512f", "avx512_vnni"})) == "avx512_vnni"
    assert ort_int8_config(frozenset({"sse4_2"})) is None
    latencies = [float(i) for i in range(1, 201)]
    assert (percentile(latencies, 50), percentile(latencies, 99)) == (100.0, 198.0)
    assert percentile([7.0], 99) == 7.0
    texts = [f"t{i}" for i in range(1000)]
    picked = latency_texts(texts, 200)
    assert len(picked) == 200 and picked[:2] == ["t0", "t5"] and picked == latency_texts(texts, 200)


def test_a_run_becomes_a_results_file_the_performance_page_renders():
    """peers.py's result.json is what benchmarks/performance_page.py reads: tokens/s per row that ran, the CPU class
    from the flags, the command; a failed row is left out."""
    from benchmarks.peer_runners.report import cpu_class, results_file
    from benchmarks.performance_page import render

    rows = [Row("st-torch", "fp32", seconds=2.0, cos_min=1.0), Row("embedserv-grpc", "fp32", seconds=1.0, cos_min=1.0),
            Row("vllm-server", "fp32", notes="failed")]  # fmt: skip
    facts = dict(flags=frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}), cpu="AMD EPYC", cores=2,
                 date="2026-11-28 02:30", commit="abc1234", texts=100, tokens=8000)  # fmt: skip
    result = results_file(rows, facts, "minilm (all-MiniLM-L6-v2)", "python benchmarks/peers.py --model minilm", "s")
    assert result["cpu_class"] == "AVX-512 + bf16 + VNNI" and result["date"] == "2026-11-28"
    assert result["cpu"] == "AMD EPYC, avx2 avx512f avx512_bf16 avx512_vnni, 2 cores"
    assert [(r["system"], r["tokens_per_s"]) for r in result["rows"]] == [
        ("sentence-transformers (torch)", 4000), ("embedserv gRPC", 8000)
    ]  # fmt: skip
    assert cpu_class(frozenset({"avx2"})) == "AVX2" and cpu_class(frozenset({"avx512f", "amx_tile"})) == "AMX"
    page = render([("run", json.loads(json.dumps(result)))])
    assert "| sentence-transformers (torch) | fp32 | 4,000 | 2.00x | 1.000 |" in page
