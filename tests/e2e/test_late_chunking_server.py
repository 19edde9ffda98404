"""Late chunking through the server: gRPC Embed's late_chunking and chunks, the OpenAI extension (one data item
per chunk with input_index, start and end), and the refusals of both faces (INVALID_ARGUMENT / 400) with
messages that say what to change. The vectors themselves are checked against transformers in
tests/models/test_late_chunking.py; here the faces must carry the engine's answer unchanged."""

from __future__ import annotations

import base64

import grpc
import httpx
import numpy as np
import pytest

from tests.helpers.classic_models import build_classic_encoder
from tests.helpers.client import RPC_TIMEOUT_S, inference_stub
from tests.helpers.compat_http import assert_openai_error
from tests.helpers.models import bundled_model_dir
from tests.helpers.sparse_models import build_splade_encoder

TEXTS = ["The quick brown fox. It jumps over the lazy dog!", "Servers answer over HTTP and gRPC alike."]
SPANS = [[(0, 20), (21, 48), (0, 1), (47, 48)], [(0, 7), (8, 40)]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers.inprocess import in_process_server
    from tests.helpers.server import free_port

    root = tmp_path_factory.mktemp("late-chunking-models")
    models = {
        "minilm": bundled_model_dir(),
        "dense": build_classic_encoder(root, "mpnet", "mean", dense=(32, "tanh")),
        "splade": build_splade_encoder(root, "bert", "max", "relu"),
    }
    port = free_port()
    args = ["--dtype", "float32", "--device", "cpu", "--http-port", str(port)]
    for name, path in models.items():
        args += ["--model", str(path), "--served-model-name", name]
    with in_process_server(args) as (target, _):
        yield target, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server[0]) as channel:
        yield inference_stub(channel)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[1], timeout=RPC_TIMEOUT_S) as client:
        yield client


def _pb():
    from embedserv.v1 import embedserv_pb2

    return embedserv_pb2


def _late(splitter: str = "spans", spans=(), **fields):
    pb = _pb()
    return pb.LateChunking(
        splitter=pb.ChunkSplitter.Value(f"CHUNK_SPLITTER_{splitter.upper()}"),
        spans=[pb.CharSpans(spans=[pb.CharSpan(start=s, end=e) for s, e in entry]) for entry in spans],
        **fields,
    )


def _grpc(stub, texts=TEXTS, model="minilm", **fields):
    return stub.Embed(_pb().EmbedRequest(model=model, inputs=texts, **fields), timeout=RPC_TIMEOUT_S)


def test_grpc_answers_one_vector_per_span_in_input_order(stub):
    reply = _grpc(stub, late_chunking=_late(spans=SPANS))
    assert len(reply.embeddings) == 0 and len(reply.chunks) == len(TEXTS)
    for entry, spans in zip(reply.chunks, SPANS, strict=True):
        assert [(c.start, c.end) for c in entry.chunks] == spans
        vectors = np.array([list(c.embedding.values) for c in entry.chunks])
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    as_bytes = _grpc(stub, late_chunking=_late(spans=SPANS), encoding=_pb().ENCODING_BYTES)
    floats = np.frombuffer(as_bytes.chunks[1].chunks[0].embedding.raw, dtype="<f4")
    np.testing.assert_array_equal(floats, np.array(reply.chunks[1].chunks[0].embedding.values, dtype=np.float32))
    # Usage: each input runs once with its two special tokens.
    assert reply.usage.prompt_tokens == _grpc(stub).usage.prompt_tokens


def test_a_model_with_dense_modules_answers_in_its_embedding_space(stub):
    reply = _grpc(stub, model="dense", late_chunking=_late(spans=SPANS))
    assert [len(entry.chunks) for entry in reply.chunks] == [4, 2]
    assert all(len(c.embedding.values) == 32 for entry in reply.chunks for c in entry.chunks)


def test_grpc_sentence_and_token_splitters(stub):
    sentences = _grpc(stub, texts=TEXTS[:1], late_chunking=_late("sentences"))
    assert [(c.start, c.end) for c in sentences.chunks[0].chunks] == [(0, 20), (21, 48)]
    windows = _grpc(stub, texts=TEXTS[:1], late_chunking=_late("tokens", chunk_tokens=4, overlap_tokens=1))
    spans = [(c.start, c.end) for c in windows.chunks[0].chunks]
    assert spans[0][0] == 0 and spans[-1][1] == len(TEXTS[0]) and len(spans) == 4


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_openai_extension_lists_the_chunks_with_their_inputs_and_spans(stub, http, encoding_format):
    late = {"splitter": "spans", "spans": SPANS}
    body = {"model": "minilm", "input": TEXTS, "late_chunking": late, "encoding_format": encoding_format}
    reply = http.post("/v1/embeddings", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    expected = _grpc(stub, late_chunking=_late(spans=SPANS))
    placed = [(i, (c.start, c.end), c.embedding.values) for i, e in enumerate(expected.chunks) for c in e.chunks]
    assert [d["index"] for d in data] == list(range(len(placed)))
    assert [(d["input_index"], (d["start"], d["end"])) for d in data] == [(i, span) for i, span, _ in placed]
    for item, (_, _, values) in zip(data, placed, strict=True):
        vector = item["embedding"]
        got = np.frombuffer(base64.b64decode(vector), "<f4") if encoding_format == "base64" else np.array(vector)
        np.testing.assert_array_equal(got.astype(np.float32), np.array(values, dtype=np.float32))
    assert reply.json()["usage"]["prompt_tokens"] == expected.usage.prompt_tokens


# (what the call sends, as gRPC fields and as the OpenAI body's extras, the message fragment)
REFUSALS = {
    "spans per input": (dict(late=dict(spans=SPANS[:1])), "1 entries for 2 inputs"),
    "span past the end": (dict(late=dict(spans=[[(0, 999)], [(0, 1)]])), "input 0: span 0 [0, 999) is not within"),
    "empty span list": (dict(late=dict(spans=[[(0, 3)], []])), "late_chunking.spans[1] is empty"),
    "span without a token": (dict(texts=["a    b"], late=dict(spans=[[(1, 4)]])), "span 0 [1, 4) covers no token"),
    "zero chunk_tokens": (dict(late=dict(splitter="tokens")), "chunk_tokens of at least 1"),
    "overlap too large": (
        dict(late=dict(splitter="tokens", chunk_tokens=4, overlap_tokens=4)),
        "less than chunk_tokens",
    ),
    "spans with sentences": (dict(late=dict(splitter="sentences", spans=SPANS)), "spans apply to the spans splitter"),
    "with chunking": (dict(late=dict(spans=SPANS), chunking=True), "cannot be combined"),
    "no dense output": (dict(model="splade", late=dict(spans=SPANS)), "cannot serve Embed"),
}


def _grpc_fields(case: dict) -> dict:
    late = dict(case["late"])
    fields = {"late_chunking": _late(late.pop("splitter", "spans"), late.pop("spans", ()), **late)}
    if case.get("chunking"):
        fields["chunking"] = _pb().CHUNKING_MEAN
    return fields


@pytest.mark.parametrize("name", list(REFUSALS))
def test_bad_calls_are_invalid_argument_over_grpc(stub, name):
    case, fragment = REFUSALS[name]
    with pytest.raises(grpc.RpcError) as caught:
        _grpc(stub, texts=case.get("texts", TEXTS), model=case.get("model", "minilm"), **_grpc_fields(case))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in caught.value.details()


@pytest.mark.parametrize("name", list(REFUSALS))
def test_bad_calls_are_400_over_http(http, name):
    case, fragment = REFUSALS[name]
    body = {"model": case.get("model", "minilm"), "input": case.get("texts", TEXTS), "late_chunking": case["late"]}
    if case.get("chunking"):
        body["chunking"] = "mean"
    error = assert_openai_error(http.post("/v1/embeddings", json=body), 400)
    assert fragment in error["message"]


def test_grpc_refuses_other_outputs_and_http_refuses_token_ids_and_unknown_options(stub, http):
    with pytest.raises(grpc.RpcError) as caught:
        _grpc(stub, late_chunking=_late(spans=SPANS), outputs=[_pb().OUTPUT_DENSE, _pb().OUTPUT_MULTI_VECTOR])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dense vectors only" in caught.value.details()
    token_ids = {"model": "minilm", "input": [[101, 2000, 102]], "late_chunking": {"spans": [[(0, 1)]]}}
    assert "applies to texts" in assert_openai_error(http.post("/v1/embeddings", json=token_ids), 400)["message"]
    typo = {"model": "minilm", "input": TEXTS, "late_chunking": {"splitter": "tokens", "chunk_size": 8}}
    assert_openai_error(http.post("/v1/embeddings", json=typo), 400)


def test_the_python_clients_embed_chunks(server, stub):
    import asyncio

    from embedserv_client import AsyncClient, Client, TextChunks

    expected = _grpc(stub, late_chunking=_late(spans=SPANS), encoding=_pb().ENCODING_FLOAT16)
    with Client(server[0], model="minilm", batch_size=1) as client:
        both = client.embed_chunks(TEXTS, spans=SPANS, encoding="float16")
        one = client.embed_chunks(TEXTS[0], splitter="sentences")
    assert [c.spans for c in both] == SPANS and isinstance(one, TextChunks)
    for got, entry in zip(both, expected.chunks, strict=True):
        assert got.vectors.dtype == np.float16
        want = np.stack([np.frombuffer(c.embedding.raw, "<f2") for c in entry.chunks])
        np.testing.assert_array_equal(got.vectors, want)
    assert one.spans == [(0, 20), (21, 48)] and one.vectors.shape == (2, 384)
    assert both[0].encoding_scale == 0.0

    with Client(server[0], model="minilm") as client:
        codes = client.embed_chunks(TEXTS[0], spans=SPANS[0], encoding="int8")
    as_int8 = _grpc(stub, late_chunking=_late(spans=SPANS), encoding=_pb().ENCODING_INT8)
    assert codes.vectors.dtype == np.int8 and codes.encoding_scale == as_int8.encoding_scale > 0
    np.testing.assert_array_equal(codes.vectors[0], np.frombuffer(as_int8.chunks[0].chunks[0].embedding.raw, np.int8))

    async def windows():
        async with AsyncClient(server[0], model="minilm") as client:
            return await client.embed_chunks(TEXTS, splitter="tokens", chunk_tokens=4, overlap_tokens=1)

    assert [len(c.spans) for c in asyncio.run(windows())] == [4, 3]


def test_the_cli_embeds_chunks(server, capsys):
    import json

    from embedserv_client import cli

    args = ["--target", server[0], "--model", "minilm", "embed-chunks", TEXTS[0], "--dimensions", "8"]
    assert cli.main(args) == 0
    [entry] = json.loads(capsys.readouterr().out)["inputs"]
    assert [(c["start"], c["end"]) for c in entry["chunks"]] == [(0, 20), (21, 48)]
    assert all(len(c["embedding"]) == 8 for c in entry["chunks"])
