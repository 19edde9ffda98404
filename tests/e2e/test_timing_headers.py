"""TEI's timing headers on every HTTP route and the same values as gRPC trailing metadata (embedserv.v1 and
tei.v1), on the session's compat server: present, whole milliseconds, non-negative and consistent
(tokenization + queue + inference <= total); a server-sent-event stream carries none (it starts before any
compute) and an error none but its request id."""

from __future__ import annotations

import grpc
import pytest

from embedserv.tei.v1 import tei_pb2 as tei_pb
from embedserv.tei.v1 import tei_pb2_grpc as tei_grpc
from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import http, pb, stub  # noqa: F401 (fixtures)
from tests.helpers.compat_server import CLASSIFIER, CROSS, EMBEDDER, GENERATOR, SPARSE

COMPUTE = ("x-tokenization-time", "x-queue-time", "x-inference-time")
ALWAYS = ("x-total-time", "x-compute-time")
TEXTS = ["timing headers are measured", "not estimated"]
DOCS = ["a document about timing", "another one"]

# (method, path, body, extra headers, whether the engine ran: the compute headers come with it)
ROUTES = [
    ("POST", "/v1/embeddings", {"model": EMBEDDER, "input": TEXTS}, {}, True),
    ("POST", "/v1/rerank", {"model": CROSS, "query": "timing", "documents": DOCS}, {}, True),
    ("POST", "/rerank", {"query": "timing", "texts": DOCS}, {"x-embedserv-model": CROSS}, True),
    ("POST", "/v1/classify", {"model": CLASSIFIER, "input": TEXTS}, {}, True),
    ("POST", "/v1/score", {"model": CROSS, "text_1": "timing", "text_2": DOCS}, {}, True),
    ("POST", "/embed", {"inputs": TEXTS}, {}, True),
    ("POST", "/embed_all", {"inputs": TEXTS}, {}, True),
    ("POST", "/embed_sparse", {"inputs": TEXTS}, {"x-embedserv-model": SPARSE}, True),
    ("POST", "/predict", {"inputs": TEXTS[0]}, {"x-embedserv-model": CLASSIFIER}, True),
    ("POST", "/tokenize", {"inputs": TEXTS}, {}, False),
    ("POST", "/decode", {"ids": [101, 102]}, {}, False),
    ("GET", "/info", None, {}, False),
    ("GET", "/v1/models", None, {}, False),
    ("GET", "/health", None, {}, False),
    ("POST", "/v1/completions", {"model": GENERATOR, "prompt": "hi", "max_tokens": 2}, {}, False),
    (
        "POST",
        "/v1/chat/completions",
        {"model": GENERATOR, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {},
        False,
    ),
]


def check_timing(values, computed: bool) -> dict[str, int]:
    """The timing fields of `values` (headers or metadata) as ints, checked; returns them."""
    names = ALWAYS + (COMPUTE if computed else ())
    got = {name: int(values[name]) for name in names}
    assert all(v >= 0 for v in got.values()), got
    assert got["x-compute-time"] == got["x-total-time"]
    if computed:
        assert got["x-tokenization-time"] + got["x-queue-time"] + got["x-inference-time"] <= got["x-total-time"]
    else:
        assert not set(COMPUTE) & set(values), values
    return got


@pytest.mark.parametrize(("method", "path", "body", "headers", "computed"), ROUTES, ids=[r[1] for r in ROUTES])
def test_every_http_route_sends_the_timing_headers(http, method, path, body, headers, computed):
    reply = http.request(method, path, json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    check_timing(reply.headers, computed)
    if computed:
        assert int(reply.headers["x-compute-tokens"]) > 0


def test_a_batch_of_long_inputs_has_measured_inference(http):
    """Enough work that the engine's share is over a millisecond: the inference time is that, not 0."""
    texts = [" ".join(["measured"] * 200) + str(i) for i in range(32)]
    reply = http.post("/embed", json={"inputs": texts, "truncate": True})
    assert reply.status_code == 200, reply.text
    assert check_timing(reply.headers, True)["x-inference-time"] >= 1


def test_an_sse_stream_and_an_error_carry_no_timing(http):
    body = {"model": GENERATOR, "prompt": "hi", "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        assert "x-request-id" in reply.headers
        assert not {*ALWAYS, *COMPUTE} & set(reply.headers)
        reply.read()
    refused = http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert refused.status_code == 404 and "x-request-id" in refused.headers
    assert not {*ALWAYS, *COMPUTE} & set(refused.headers)


def _trailers(call) -> dict[str, str]:
    return dict(call.trailing_metadata())


def _native(pb):
    return [
        ("Embed", pb.EmbedRequest(model=EMBEDDER, inputs=TEXTS), True),
        ("EmbedSparse", pb.EmbedSparseRequest(model=SPARSE, inputs=TEXTS), True),
        ("EmbedMultiVector", pb.EmbedMultiVectorRequest(model=EMBEDDER, inputs=TEXTS), True),
        ("Rerank", pb.RerankRequest(model=CROSS, query="timing", documents=DOCS), True),
        ("Classify", pb.ClassifyRequest(model=CLASSIFIER, inputs=TEXTS), True),
        ("Tokenize", pb.TokenizeRequest(model=EMBEDDER, inputs=TEXTS), False),
        ("ListModels", pb.ListModelsRequest(), False),
    ]


def test_inference_rpcs_send_timing_as_trailing_metadata(stub):
    for method, request, computed in _native(pb()):
        _, call = getattr(stub, method).with_call(request, timeout=RPC_TIMEOUT_S)
        trailers = _trailers(call)
        assert trailers["x-request-id"], method
        check_timing(trailers, computed)
        if computed:
            assert int(trailers["x-compute-tokens"]) > 0, method
    stream = stub.EmbedStream(iter([pb().EmbedRequest(model=EMBEDDER, inputs=TEXTS)] * 2), timeout=RPC_TIMEOUT_S)
    assert len(list(stream)) == 2
    check_timing(_trailers(stream), True)
    generate = stub.Generate(pb().GenerateRequest(model=GENERATOR, prompt="hi", max_tokens=2), timeout=RPC_TIMEOUT_S)
    list(generate)
    check_timing(_trailers(generate), False)
    assert int(_trailers(generate)["x-compute-tokens"]) > 0


def test_a_refused_rpc_has_only_its_request_id(stub):
    with pytest.raises(grpc.RpcError) as failed:
        stub.Embed(pb().EmbedRequest(model="nope", inputs=TEXTS), timeout=RPC_TIMEOUT_S)
    trailers = dict(failed.value.trailing_metadata())
    assert failed.value.code() is grpc.StatusCode.NOT_FOUND and set(trailers) == {"x-request-id"}


TEI_UNARY = [
    ("Embed", "Embed", lambda: tei_pb.EmbedRequest(inputs=TEXTS[0]), None, True),
    ("Embed", "EmbedSparse", lambda: tei_pb.EmbedSparseRequest(inputs=TEXTS[0]), SPARSE, True),
    ("Embed", "EmbedAll", lambda: tei_pb.EmbedAllRequest(inputs=TEXTS[0]), None, True),
    ("Predict", "Predict", lambda: tei_pb.PredictRequest(inputs=TEXTS[0]), CLASSIFIER, True),
    ("Predict", "PredictPair", lambda: tei_pb.PredictPairRequest(inputs=["timing", DOCS[0]]), CROSS, True),
    ("Rerank", "Rerank", lambda: tei_pb.RerankRequest(query="timing", texts=DOCS), None, True),
    ("Tokenize", "Tokenize", lambda: tei_pb.EncodeRequest(inputs=TEXTS[0]), None, False),
    ("Tokenize", "Decode", lambda: tei_pb.DecodeRequest(ids=[101, 102]), None, False),
    ("Info", "Info", lambda: tei_pb.InfoRequest(), None, False),
]


@pytest.mark.parametrize(
    ("service", "method", "request_of", "model", "computed"), TEI_UNARY, ids=[f"{s}.{m}" for s, m, *_ in TEI_UNARY]
)
def test_tei_rpcs_send_timing_as_trailing_metadata(compat_server, service, method, request_of, model, computed):
    metadata = (("x-embedserv-model", model),) if model else ()
    with grpc.insecure_channel(compat_server.target) as channel:
        stub = getattr(tei_grpc, f"{service}Stub")(channel)
        _, call = getattr(stub, method).with_call(request_of(), metadata=metadata, timeout=RPC_TIMEOUT_S)
        check_timing(_trailers(call), computed)


def test_tei_streams_send_timing_as_trailing_metadata(compat_server):
    with grpc.insecure_channel(compat_server.target) as channel:
        embed, rerank = tei_grpc.EmbedStub(channel), tei_grpc.RerankStub(channel)
        stream = embed.EmbedStream(iter([tei_pb.EmbedRequest(inputs=TEXTS[0])] * 3), timeout=RPC_TIMEOUT_S)
        assert len(list(stream)) == 3
        check_timing(_trailers(stream), True)
        requests = [tei_pb.RerankStreamRequest(query="timing", text=doc) for doc in DOCS]
        _, call = rerank.RerankStream.with_call(iter(requests), timeout=RPC_TIMEOUT_S)
        check_timing(_trailers(call), True)
