"""The client's retrieval outputs without a server: requests built from embed()'s options, raw encodings
decoded into numpy, split replies merged in input order, and bad option names refused before any call."""

from __future__ import annotations

import numpy as np
import pytest

from embedserv_client import EmbedOutputs, ModelInfo, SparseEmbedding, plans
from embedserv_client.v1 import embedserv_pb2 as pb


def _fields(**options) -> dict:
    return plans.embed_fields("m", None, False, "right", None, None, **options)


def test_each_encoding_is_asked_for_and_decoded_in_its_dtype():
    vector = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    cases = {
        "float32": vector,
        "float16": vector.astype(np.float16),
        "int8": np.array([-128, 0, 127], dtype=np.int8),
        "uint8": np.array([0, 128, 255], dtype=np.uint8),
        "int8_per_dimension": np.array([-128, 0, 127], dtype=np.int8),
        "uint8_per_dimension": np.array([0, 128, 255], dtype=np.uint8),
        "binary": np.array([-96], dtype=np.int8),
        "ubinary": np.array([160], dtype=np.uint8),
    }
    for name, row in cases.items():
        fields = _fields(encoding_name=name)
        assert fields["encoding"] == plans.ENCODINGS[name][0]
        raw = row.astype(row.dtype.newbyteorder("<")).tobytes()
        reply = pb.EmbedResponse(embeddings=[pb.Embedding(raw=raw)] * 2)
        matrix = plans.embed_plan(["a", "b"], 8, False, **fields).merge([reply])
        assert matrix.dtype == row.dtype and matrix.dtype.isnative and matrix.shape == (2, len(row))
        np.testing.assert_array_equal(matrix[1], row)


def test_every_encoding_has_its_own_wire_value_and_outputs_carry_the_scale():
    wires = {name: plans.ENCODINGS[name][0] for name in plans.ENCODINGS}
    assert wires["int8_per_dimension"] == pb.ENCODING_INT8_PER_DIMENSION != wires["int8"] == pb.ENCODING_INT8
    assert wires["uint8_per_dimension"] == pb.ENCODING_UINT8_PER_DIMENSION != wires["uint8"] == pb.ENCODING_UINT8
    assert len(set(wires.values())) == len(wires)
    plan = plans.embed_plan(["a", "b"], 1, False, **_fields(encoding_name="int8", output_names=["dense"]))
    replies = [pb.EmbedResponse(embeddings=[pb.Embedding(raw=bytes([i, 2]))], encoding_scale=0.25) for i in (1, 255)]
    merged = plan.merge(replies)
    assert merged.encoding_scale == 0.25 and merged.dense.tolist() == [[1, 2], [-1, 2]]
    assert (
        plans.embed_plan(["a"], 1, True, **_fields(output_names=["dense"]))
        .merge([pb.EmbedResponse(embeddings=[pb.Embedding(raw=np.zeros(2, "<f4").tobytes())])])
        .encoding_scale
        == 0.0
    )


def test_split_replies_merge_every_output_in_input_order():
    fields = _fields(output_names=["dense", "sparse", "multi_vector"], sparse_top_k=2)
    plan = plans.embed_plan(["a", "b", "c"], 2, False, **fields)
    assert [list(r.inputs) for r in plan.requests] == [["a", "b"], ["c"]]
    assert list(plan.requests[0].outputs) == [pb.OUTPUT_DENSE, pb.OUTPUT_SPARSE, pb.OUTPUT_MULTI_VECTOR]
    assert plan.requests[0].sparse_top_k == 2 and plan.inputs_per_request == 2

    def reply(*ids):
        return pb.EmbedResponse(
            embeddings=[pb.Embedding(raw=np.full(2, i, "<f4").tobytes()) for i in ids],
            sparse_embeddings=[pb.SparseEmbedding(indices=[i, 7], values=[0.5, i]) for i in ids],
            multi_vectors=[
                pb.MultiVector(num_vectors=i, dimension=2, raw=np.zeros((i, 2), "<f4").tobytes()) for i in ids
            ],
        )

    merged = plan.merge([reply(1, 2), reply(3)])
    assert isinstance(merged, EmbedOutputs)
    np.testing.assert_array_equal(merged.dense[:, 0], [1, 2, 3])
    assert [s.indices.tolist() for s in merged.sparse] == [[1, 7], [2, 7], [3, 7]]
    assert merged.sparse[2].values.dtype == np.float32 and merged.sparse[2].indices.dtype == np.int64
    assert [m.shape for m in merged.multi_vector] == [(1, 2), (2, 2), (3, 2)] and merged.multi_vector[0].flags.writeable
    one = plans.embed_plan(["a"], 2, True, **_fields(output_names="sparse")).merge([reply(4)])
    assert one.dense is None and one.multi_vector is None and isinstance(one.sparse, SparseEmbedding)
    indices, values = one.sparse
    np.testing.assert_array_equal(one.sparse.to_dense(8)[indices], values)


def test_sparse_and_multi_vector_plans():
    sparse = plans.embed_sparse_plan(["a", "b", "c"], 2, False, model="m", top_k=3)
    assert sparse.method == "EmbedSparse" and sparse.requests[1].top_k == 3
    vectors = [pb.SparseEmbedding(indices=[i], values=[1.0]) for i in range(3)]
    replies = [pb.EmbedSparseResponse(embeddings=vectors[:2]), pb.EmbedSparseResponse(embeddings=vectors[2:])]
    merged = sparse.merge(replies)
    assert [s.indices.tolist() for s in merged] == [[0], [1], [2]]
    multi = plans.embed_multi_vector_plan(["a"], 2, True, model="m", prompt_name="query")
    assert multi.method == "EmbedMultiVector" and multi.requests[0].prompt_name == "query"
    raw = np.arange(6, dtype="<f4").reshape(3, 2)
    message = pb.MultiVector(num_vectors=3, dimension=2, raw=raw.tobytes())
    got = multi.merge([pb.EmbedMultiVectorResponse(embeddings=[message])])
    np.testing.assert_array_equal(got, raw)


def test_bad_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="float16"):
        _fields(encoding_name="float64")
    with pytest.raises(ValueError, match="multi_vector"):
        _fields(output_names=["dense", "colbert"])
    with pytest.raises(ValueError, match="'mean'"):
        _fields(chunking_mode="max")
    with pytest.raises(ValueError, match="'max'"):
        plans.chunking("mean", "rerank")
    assert _fields(chunking_mode="mean")["chunking"] == pb.CHUNKING_MEAN
    assert plans.chunking(None, "rerank") == pb.CHUNKING_NONE


def test_model_info_shows_outputs_and_their_dimensions():
    message = pb.ModelInfo(
        name="bge-m3",
        tasks=[pb.TASK_EMBED, pb.TASK_EMBED_SPARSE, pb.TASK_EMBED_MULTI_VECTOR],
        outputs=[pb.OUTPUT_DENSE, pb.OUTPUT_SPARSE, pb.OUTPUT_MULTI_VECTOR],
        sparse_dimension=250002,
        multi_vector_dimension=1024,
    )
    info = ModelInfo.from_proto(message)
    assert info.tasks == ("embed", "embed_sparse", "embed_multi_vector")
    assert info.outputs == ("dense", "sparse", "multi_vector")
    assert (info.sparse_dimension, info.multi_vector_dimension) == (250002, 1024)
