"""embedserv-client's retrieval outputs against the session's compat server: compact
encodings (the bytes gRPC Embed sends, decoded to the right dtype; float16 the float32 values cast; binary
and ubinary sentence-transformers' quantize_embeddings of the float vectors; int8 / uint8 decoded by their
encoding_scale), embed(outputs=...), token
vectors (MiniLM's last hidden states) and sparse vectors (the tiny SPLADE model) as the raw stubs give them,
chunking, model info, and the refusal of an output a model does not give; split calls merge in order; the
async client's calls answer as the blocking client's."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from embedserv_client import Client, EmbedOutputs, EmbedservError, SparseEmbedding
from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.client_drivers import driver
from tests.helpers.compat_http import pb, stub  # noqa: F401 (fixtures)
from tests.helpers.compat_server import CROSS, EMBEDDER, SPARSE

TEXTS = ["A cat sits on the mat.", "Quantized vectors are small.", "naïve café ☕"]
DTYPES = {
    "float16": np.float16,
    "int8": np.int8,
    "uint8": np.uint8,
    "int8_per_dimension": np.int8,
    "uint8_per_dimension": np.uint8,
    "binary": np.int8,
    "ubinary": np.uint8,
}


@pytest.fixture(scope="module")
def client(compat_server):
    with Client(compat_server.target, model=EMBEDDER, timeout=RPC_TIMEOUT_S) as made:
        yield made


@pytest.fixture(scope="module")
def split(compat_server):
    """A client that sends 2 inputs a request (batch composition changes: equal up to rounding)."""
    with Client(compat_server.target, model=EMBEDDER, timeout=RPC_TIMEOUT_S, batch_size=2) as made:
        yield made


def grpc_raw(stub, encoding: str, texts=TEXTS, model=EMBEDDER, **fields) -> list[bytes]:
    request = pb().EmbedRequest(model=model, inputs=texts, encoding=pb().Encoding.Value(encoding), **fields)
    return [e.raw for e in stub.Embed(request, timeout=RPC_TIMEOUT_S).embeddings]


def test_encodings_are_grpcs_bytes_in_their_dtype(client, split, stub):
    from sentence_transformers.util.quantization import quantize_embeddings

    floats = client.embed(TEXTS)
    assert floats.dtype == np.float32 and floats.shape == (3, 384)
    for name, dtype in DTYPES.items():
        got = client.embed(TEXTS, encoding=name)
        assert got.dtype == dtype and got.shape == (3, 48 if "binary" in name else 384), name
        assert [row.tobytes() for row in got.astype(got.dtype.newbyteorder("<"))] == grpc_raw(
            stub, f"ENCODING_{name.upper()}"
        ), name
        if name == "float16":
            np.testing.assert_array_equal(got, floats.astype(np.float16))
        elif "binary" in name:
            np.testing.assert_array_equal(got, quantize_embeddings(floats, precision=name))
    assert client.embed(TEXTS[0], encoding="ubinary").shape == (48,)
    np.testing.assert_allclose(split.embed(TEXTS, encoding="float16"), floats, atol=1e-3)
    with pytest.raises(ValueError, match="ubinary"):
        client.embed(TEXTS, encoding="int4")


def test_int8_and_uint8_carry_the_scale_that_decodes_them(client, split, stub):
    """encoding_scale: the gRPC reply's, the same for every part of a split call; int8 codes * scale and uint8
    (codes - 128) * scale are the float vectors (uint8: centred) within one step; the per-dimension encodings
    have no scale."""
    floats = client.embed(TEXTS)
    for name in ("int8", "uint8"):
        wire = pb().Encoding.Value(f"ENCODING_{name.upper()}")
        request = pb().EmbedRequest(model=EMBEDDER, inputs=TEXTS, encoding=wire)
        wire_scale = stub.Embed(request, timeout=RPC_TIMEOUT_S).encoding_scale
        got = client.embed(TEXTS, encoding=name, outputs=["dense"])
        assert got.encoding_scale == split.embed(TEXTS, encoding=name, outputs="dense").encoding_scale == wire_scale
        assert 0 < wire_scale < 1 / 127, "MiniLM's normalized values are well under 1"
        if name == "int8":
            decoded, expected = got.dense * wire_scale, floats
        else:
            decoded = (got.dense.astype(np.float64) - 128) * wire_scale
            expected = floats - floats.mean(axis=1, keepdims=True)
        assert np.abs(decoded - expected).max() <= wire_scale, name
    assert client.embed(TEXTS, encoding="int8_per_dimension", outputs=["dense"]).encoding_scale == 0.0


def test_outputs_and_multi_vector_equal_the_stubs(client, split, stub):
    request = pb().EmbedMultiVectorRequest(model=EMBEDDER, inputs=TEXTS)
    native = stub.EmbedMultiVector(request, timeout=RPC_TIMEOUT_S).embeddings
    expected = [np.frombuffer(m.raw, "<f4").reshape(m.num_vectors, m.dimension) for m in native]
    vectors = client.embed_multi_vector(TEXTS)
    assert [v.shape for v in vectors] == [e.shape for e in expected] and expected[0].shape[1] == 384
    for got, want in zip(vectors, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(client.embed_multi_vector(TEXTS[2]), expected[2])
    for got, want in zip(split.embed_multi_vector(TEXTS), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    both = client.embed(TEXTS, outputs=["dense", "multi_vector"], encoding="float16")
    assert isinstance(both, EmbedOutputs) and both.sparse is None
    np.testing.assert_array_equal(both.dense, client.embed(TEXTS, encoding="float16"))
    for got, want in zip(both.multi_vector, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)  # batched with the dense output: other batch shapes


def test_sparse_equals_the_stub_and_top_k_keeps_the_largest(client, split, stub):
    native = stub.EmbedSparse(pb().EmbedSparseRequest(model=SPARSE, inputs=TEXTS), timeout=RPC_TIMEOUT_S)
    vectors = client.embed_sparse(TEXTS, model=SPARSE)
    assert len(vectors) == 3
    for got, want in zip(vectors, native.embeddings, strict=True):
        assert got.indices.dtype == np.int64 and got.values.dtype == np.float32 and len(got.indices) > 10
        assert got.indices.tolist() == list(want.indices)
        np.testing.assert_array_equal(got.values, np.asarray(want.values, dtype=np.float32))
    indices, values = client.embed_sparse(TEXTS[0], model=SPARSE, top_k=5)
    full = vectors[0].to_dense(30522)
    assert list(indices) == sorted(indices) and len(values) == 5
    assert sorted(values.tolist()) == sorted(full)[-5:] and (full[indices] == values).all()
    mixed = split.embed(TEXTS, model=SPARSE, outputs="sparse", sparse_top_k=5)
    assert mixed.dense is None and isinstance(mixed.sparse[0], SparseEmbedding)
    assert mixed.sparse[0].indices.tolist() == indices.tolist()


def test_chunking_equals_the_stubs(client, stub):
    long_text = "Chunked text goes on. " * 150  # ~750 tokens: two windows of MiniLM's 256 and one more
    mean = client.embed([long_text, TEXTS[0]], chunking="mean", encoding="int8")
    assert [row.tobytes() for row in mean] == grpc_raw(
        stub, "ENCODING_INT8", [long_text, TEXTS[0]], chunking=pb().CHUNKING_MEAN
    )
    documents = [long_text, TEXTS[1], TEXTS[0]]
    ranked = client.rerank(TEXTS[0], documents, chunking="max", model=CROSS)
    request = pb().RerankRequest(model=CROSS, query=TEXTS[0], documents=documents, chunking=pb().CHUNKING_MAX)
    native = stub.Rerank(request, timeout=RPC_TIMEOUT_S).results
    assert [(r.index, r.score) for r in ranked] == [(r.index, r.score) for r in native]


def test_model_info_and_a_missing_output_is_refused(client):
    models = {m.name: m for m in client.models()}
    embedder, sparse = models[EMBEDDER], models[SPARSE]
    assert (embedder.outputs, embedder.multi_vector_dimension, embedder.sparse_dimension) == (
        ("dense", "multi_vector"),
        384,
        0,
    )
    assert "embed_multi_vector" in embedder.tasks and "embed_sparse" not in embedder.tasks
    assert (sparse.outputs, sparse.sparse_dimension, sparse.tasks) == (("sparse",), 30522, ("embed_sparse",))
    with pytest.raises(EmbedservError) as caught:
        client.embed_sparse(TEXTS[0])
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot serve EmbedSparse; it serves: embed, embed_multi_vector" in caught.value.details


def test_the_async_client_answers_as_the_blocking_one(client, compat_server):
    texts, documents = TEXTS[:2], ["Chunked text goes on. " * 100, TEXTS[1]]
    aio = driver("async", compat_server.target, model=EMBEDDER, timeout=RPC_TIMEOUT_S)
    np.testing.assert_array_equal(aio.embed(texts, encoding="binary"), client.embed(texts, encoding="binary"))
    for got, want in zip(aio.embed_multi_vector(texts), client.embed_multi_vector(texts), strict=True):
        np.testing.assert_array_equal(got, want)
    both = aio.embed(texts, outputs=["multi_vector", "dense"])
    assert both.dense.shape == (2, 384) and both.multi_vector[1].shape == want.shape
    got, want = aio.embed_sparse(texts[0], model=SPARSE, top_k=3), client.embed_sparse(texts[0], model=SPARSE, top_k=3)
    assert got.indices.tolist() == want.indices.tolist()
    ranked = [c.rerank(TEXTS[0], documents, chunking="max", model=CROSS) for c in (aio, client)]
    assert [(r.index, r.score) for r in ranked[0]] == [(r.index, r.score) for r in ranked[1]]
    assert {m.name: m.outputs for m in aio.models()}[SPARSE] == ("sparse",)
