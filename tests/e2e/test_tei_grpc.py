"""TEI's gRPC API (tei.v1) on our gRPC port: on the shared compat server, each TEI call answers what our own
embedserv.v1 call answers for the same text and model; the model is picked with x-embedserv-model metadata
(else the first served model that can do the task: EmbedSparse the tiny SPLADE model's, EmbedAll MiniLM's
token vectors); what we do not serve is refused with the right code."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import embedserv
from embedserv.tei.v1 import tei_pb2 as pb
from embedserv.tei.v1 import tei_pb2_grpc as pb_grpc
from embedserv.v1 import embedserv_pb2 as native_pb
from tests.helpers.client import RPC_TIMEOUT_S, inference_stub
from tests.helpers.compat_server import CLASSIFIER, CROSS, EMBEDDER, MAX_CLIENT_BATCH, MAX_CONCURRENT, SPARSE

TEXT = "Check whether a file is a ZIP file"
DOCUMENTS = ["zipfile.is_zipfile tests a path", "The weather is nice today", "Open a tar archive", "ZIP it"]
TEXTS = [f"text number {i} about archives and files" for i in range(20)]


def _model(name: str) -> tuple[tuple[str, str], ...]:
    return (("x-embedserv-model", name),)


@pytest.fixture(scope="module")
def channel(compat_server):
    with grpc.insecure_channel(compat_server.target) as channel:
        yield channel


@pytest.fixture(scope="module")
def native(channel):
    return inference_stub(channel)


@pytest.fixture(scope="module")
def tei(channel):
    services = ("Info", "Embed", "Predict", "Rerank", "Tokenize")
    return {name: getattr(pb_grpc, f"{name}Stub")(channel) for name in services}


def _native_embeddings(native, texts, **fields) -> np.ndarray:
    response = native.Embed(native_pb.EmbedRequest(inputs=texts, model=EMBEDDER, **fields), timeout=RPC_TIMEOUT_S)
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def test_embed_equals_native_embed(tei, native):
    response = tei["Embed"].Embed(pb.EmbedRequest(inputs=TEXT), timeout=RPC_TIMEOUT_S)
    np.testing.assert_allclose(response.embeddings, _native_embeddings(native, [TEXT])[0], atol=1e-6)
    assert response.metadata.compute_chars == len(TEXT)
    usage = native.Embed(native_pb.EmbedRequest(inputs=[TEXT], model=EMBEDDER), timeout=RPC_TIMEOUT_S).usage
    assert response.metadata.compute_tokens == usage.prompt_tokens
    assert response.metadata.total_time_ns > 0
    # normalize is optional in TEI's proto: unset means true, an explicit false is honoured; dimensions cut.
    raw = tei["Embed"].Embed(pb.EmbedRequest(inputs=TEXT, normalize=False, dimensions=16), timeout=RPC_TIMEOUT_S)
    expected = _native_embeddings(native, [TEXT], normalize=False, dimensions=16)[0]
    np.testing.assert_allclose(raw.embeddings, expected, atol=1e-6)


def test_embed_stream_answers_each_request_in_order(tei, native):
    responses = list(tei["Embed"].EmbedStream(iter(pb.EmbedRequest(inputs=t) for t in TEXTS), timeout=RPC_TIMEOUT_S))
    got = np.array([r.embeddings for r in responses], dtype=np.float32)
    np.testing.assert_allclose(got, _native_embeddings(native, TEXTS), atol=1e-6)
    assert [r.metadata.compute_chars for r in responses] == [len(t) for t in TEXTS]


def test_embed_all_equals_native_multi_vector(tei, native):
    response = tei["Embed"].EmbedAll(pb.EmbedAllRequest(inputs=TEXT), timeout=RPC_TIMEOUT_S)
    request = native_pb.EmbedMultiVectorRequest(model=EMBEDDER, inputs=[TEXT, *TEXTS[:2]])
    reply = native.EmbedMultiVector(request, timeout=RPC_TIMEOUT_S)
    want = [np.frombuffer(m.raw, "<f4").reshape(m.num_vectors, m.dimension) for m in reply.embeddings]
    np.testing.assert_allclose([t.embeddings for t in response.token_embeddings], want[0], atol=1e-5)
    assert response.metadata.compute_chars == len(TEXT) and response.metadata.compute_tokens == len(want[0])
    streamed = tei["Embed"].EmbedAllStream(iter(pb.EmbedAllRequest(inputs=t) for t in TEXTS[:2]), timeout=RPC_TIMEOUT_S)
    for got, expected in zip(streamed, want[1:], strict=True):
        np.testing.assert_allclose([t.embeddings for t in got.token_embeddings], expected, atol=1e-5)


def test_embed_sparse_equals_native_sparse(tei, native):
    """Without metadata, the first served model with the sparse output answers."""
    request = native_pb.EmbedSparseRequest(model=SPARSE, inputs=[TEXT, *TEXTS[:2]])
    want = native.EmbedSparse(request, timeout=RPC_TIMEOUT_S).embeddings
    response = tei["Embed"].EmbedSparse(pb.EmbedSparseRequest(inputs=TEXT), timeout=RPC_TIMEOUT_S)
    streamed = list(
        tei["Embed"].EmbedSparseStream(iter(pb.EmbedSparseRequest(inputs=t) for t in TEXTS[:2]), timeout=RPC_TIMEOUT_S)
    )
    for got, expected in zip([response, *streamed], want, strict=True):
        assert [v.index for v in got.sparse_embeddings] == list(expected.indices) and expected.indices
        np.testing.assert_allclose([v.value for v in got.sparse_embeddings], expected.values, atol=1e-6)


def test_predict_equals_native_classify_best_first(tei, native):
    request = pb.PredictRequest(inputs=TEXT)
    response = tei["Predict"].Predict(request, metadata=_model(CLASSIFIER), timeout=RPC_TIMEOUT_S)
    expected = native.Classify(native_pb.ClassifyRequest(inputs=[TEXT], model=CLASSIFIER), timeout=RPC_TIMEOUT_S)
    scores = [p.score for p in response.predictions]
    assert scores == sorted(scores, reverse=True)
    assert {p.label: p.score for p in response.predictions} == {
        s.label: s.score for s in expected.classifications[0].scores
    }
    assert {p.label for p in response.predictions} == {"negative", "neutral", "positive"}
    # PredictStream answers each text as Predict does; PredictPair with one input is Predict.
    streamed = list(
        tei["Predict"].PredictStream(iter([request, request]), metadata=_model(CLASSIFIER), timeout=RPC_TIMEOUT_S)
    )
    single = tei["Predict"].PredictPair(
        pb.PredictPairRequest(inputs=[TEXT]), metadata=_model(CLASSIFIER), timeout=RPC_TIMEOUT_S
    )
    for other in (*streamed, single):
        # Equal up to float32 rounding: a stream's texts may share a batch, which sums in another order.
        assert [p.label for p in other.predictions] == [p.label for p in response.predictions]
        np.testing.assert_allclose(
            [p.score for p in other.predictions], [p.score for p in response.predictions], rtol=0, atol=1e-6
        )


def test_predict_without_metadata_uses_the_first_classifier(tei):
    # tiny-ce (a one-label cross-encoder) classifies too, and comes before tiny-cls in --model order.
    response = tei["Predict"].Predict(pb.PredictRequest(inputs=TEXT), timeout=RPC_TIMEOUT_S)
    assert [p.label for p in response.predictions] == ["LABEL_0"]


def test_predict_pair_is_the_cross_encoder_score(tei, native):
    pair = [TEXT, DOCUMENTS[0]]
    expected = native.Rerank(
        native_pb.RerankRequest(query=pair[0], documents=pair[1:], model=CROSS), timeout=RPC_TIMEOUT_S
    )
    # No metadata: the first served cross-encoder (minilm reranks by cosine, which scores no pair).
    response = tei["Predict"].PredictPair(pb.PredictPairRequest(inputs=pair), timeout=RPC_TIMEOUT_S)
    assert [p.label for p in response.predictions] == ["LABEL_0"]
    # Scores equal up to float32 rounding: a stream's pairs may share a batch, which sums in another order.
    assert response.predictions[0].score == pytest.approx(expected.results[0].score, abs=1e-6)
    streamed = list(
        tei["Predict"].PredictPairStream(iter([pb.PredictPairRequest(inputs=pair)] * 3), timeout=RPC_TIMEOUT_S)
    )
    for r in streamed:
        assert [p.label for p in r.predictions] == ["LABEL_0"]
        assert r.predictions[0].score == pytest.approx(response.predictions[0].score, abs=1e-6)
    with pytest.raises(grpc.RpcError) as info:
        tei["Predict"].PredictPair(pb.PredictPairRequest(inputs=pair), metadata=_model(CLASSIFIER))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cross-encoder" in info.value.details() and CROSS in info.value.details()


@pytest.mark.parametrize("model", [CROSS, None])
def test_rerank_equals_native_rerank(tei, native, model):
    metadata = _model(model) if model else None
    request = pb.RerankRequest(query=TEXT, texts=DOCUMENTS, return_text=True)
    response = tei["Rerank"].Rerank(request, metadata=metadata, timeout=RPC_TIMEOUT_S)
    # No metadata: minilm, the first served model that reranks.
    native_request = native_pb.RerankRequest(query=TEXT, documents=DOCUMENTS, model=model or EMBEDDER)
    expected = native.Rerank(native_request, timeout=RPC_TIMEOUT_S)
    assert [(r.index, r.score) for r in response.ranks] == [(r.index, r.score) for r in expected.results]
    assert [r.text for r in response.ranks] == [DOCUMENTS[r.index] for r in response.ranks]
    assert response.metadata.compute_chars == len(TEXT) * len(DOCUMENTS) + sum(map(len, DOCUMENTS))
    assert response.metadata.compute_tokens == expected.usage.prompt_tokens
    without_text = tei["Rerank"].Rerank(pb.RerankRequest(query=TEXT, texts=DOCUMENTS), metadata=metadata)
    assert not any(r.HasField("text") for r in without_text.ranks)


def test_rerank_stream_ranks_every_request_together(tei, native):
    # raw_scores and return_text are read from the first request only.
    requests = [pb.RerankStreamRequest(query=TEXT, text=DOCUMENTS[0], raw_scores=True, return_text=True)]
    requests += [pb.RerankStreamRequest(query=TEXT, text=d) for d in DOCUMENTS[1:]]
    response = tei["Rerank"].RerankStream(iter(requests), metadata=_model(CROSS), timeout=RPC_TIMEOUT_S)
    unary = tei["Rerank"].Rerank(
        pb.RerankRequest(query=TEXT, texts=DOCUMENTS, raw_scores=True, return_text=True),
        metadata=_model(CROSS),
        timeout=RPC_TIMEOUT_S,
    )
    assert list(response.ranks) == list(unary.ranks)
    # Each request keeps its own query, as in TEI: a pair scores the same whatever else the stream holds.
    other = "Parse a date"
    requests = [pb.RerankStreamRequest(query=q, text=d) for q, d in ((TEXT, DOCUMENTS[0]), (other, DOCUMENTS[1]))]
    mixed = tei["Rerank"].RerankStream(iter(requests), metadata=_model(CROSS), timeout=RPC_TIMEOUT_S)
    alone = native.Rerank(
        native_pb.RerankRequest(query=other, documents=DOCUMENTS[1:2], model=CROSS), timeout=RPC_TIMEOUT_S
    )
    assert {r.index: r.score for r in mixed.ranks}[1] == alone.results[0].score


def test_tokenize_equals_native_tokenize(tei, native):
    text = "Tokenizing texts, quickly!"
    response = tei["Tokenize"].Tokenize(pb.EncodeRequest(inputs=text, add_special_tokens=True), timeout=RPC_TIMEOUT_S)
    expected = native.Tokenize(native_pb.TokenizeRequest(inputs=[text], model=EMBEDDER), timeout=RPC_TIMEOUT_S)
    tokens, native_tokens = list(response.tokens), list(expected.inputs[0].tokens)
    assert [(t.id, t.special) for t in tokens] == [(t.id, t.special) for t in native_tokens]
    assert tokens[0].special and tokens[-1].special  # [CLS] ... [SEP]
    for token, native_token in zip(tokens, native_tokens, strict=True):
        if token.special:
            # TEI: a special token's own text, no offsets.
            assert token.text == native_token.text and not token.HasField("start") and not token.HasField("stop")
        else:
            # TEI: the piece of the input (as sent: MiniLM's tokenizer lower-cases), not the "##" word piece.
            assert (token.start, token.stop) == (native_token.start, native_token.end)
            assert token.text == text[token.start : token.stop]
    # proto3's add_special_tokens defaults to false, as in TEI; TokenizeStream answers in order.
    streamed = list(tei["Tokenize"].TokenizeStream(iter([pb.EncodeRequest(inputs=text)] * 2), timeout=RPC_TIMEOUT_S))
    assert [[t.id for t in r.tokens] for r in streamed] == [[t.id for t in tokens[1:-1]]] * 2


def test_tokenize_offsets_are_utf8_bytes_as_in_tei(tei):
    text = "café déjà vu"
    response = tei["Tokenize"].Tokenize(pb.EncodeRequest(inputs=text), timeout=RPC_TIMEOUT_S)
    encoded = text.encode()
    assert response.tokens[-1].stop == len(encoded)
    for token in response.tokens:
        assert encoded[token.start : token.stop].decode() == token.text


def test_decode_round_trips(tei):
    text = "the quick brown fox jumps over the lazy dog"
    tokens = tei["Tokenize"].Tokenize(pb.EncodeRequest(inputs=text, add_special_tokens=True), timeout=RPC_TIMEOUT_S)
    ids = [t.id for t in tokens.tokens]
    decoded = tei["Tokenize"].Decode(pb.DecodeRequest(ids=ids, skip_special_tokens=True), timeout=RPC_TIMEOUT_S)
    assert decoded.text == text
    with_special = tei["Tokenize"].Decode(pb.DecodeRequest(ids=ids), timeout=RPC_TIMEOUT_S)
    assert with_special.text == f"[CLS] {text} [SEP]"
    requests = [pb.DecodeRequest(ids=ids, skip_special_tokens=True)] * 2
    streamed = list(tei["Tokenize"].DecodeStream(iter(requests), timeout=RPC_TIMEOUT_S))
    assert [r.text for r in streamed] == [text, text]


@pytest.mark.parametrize(
    "model, model_type",
    [(None, "MODEL_TYPE_EMBEDDING"), (CROSS, "MODEL_TYPE_RERANKER"), (CLASSIFIER, "MODEL_TYPE_CLASSIFIER")],
)
def test_info_describes_the_chosen_model(tei, native, model, model_type):
    info = tei["Info"].Info(pb.InfoRequest(), metadata=_model(model) if model else None, timeout=RPC_TIMEOUT_S)
    listed = {m.name: m for m in native.ListModels(native_pb.ListModelsRequest(), timeout=RPC_TIMEOUT_S).models}
    expected = listed[model or EMBEDDER]
    assert info.model_id == expected.name
    assert pb.ModelType.Name(info.model_type) == model_type
    assert info.version == embedserv.__version__
    assert info.model_dtype == expected.dtype == "float32"
    assert info.max_input_length == expected.max_input_tokens
    assert (info.max_client_batch_size, info.max_concurrent_requests) == (MAX_CLIENT_BATCH, MAX_CONCURRENT)
    assert info.max_batch_tokens > 0 and info.HasField("max_batch_requests") and info.tokenization_workers >= 1


LEFT = pb.TRUNCATION_DIRECTION_LEFT
# name -> (call on the TEI stubs, the code it ends with, a word its message holds)
BAD_CALLS = {
    "empty inputs": (lambda t: t["Embed"].Embed(pb.EmbedRequest(inputs="")), "INVALID_ARGUMENT", "empty"),
    "unknown model": (
        lambda t: t["Embed"].Embed(pb.EmbedRequest(inputs=TEXT), metadata=_model("nope")),
        "NOT_FOUND",
        "nope",
    ),
    "left truncation": (
        lambda t: t["Rerank"].Rerank(pb.RerankRequest(query=TEXT, texts=DOCUMENTS, truncation_direction=LEFT)),
        "INVALID_ARGUMENT",
        "left",
    ),
    "no texts": (lambda t: t["Rerank"].Rerank(pb.RerankRequest(query=TEXT)), "INVALID_ARGUMENT", "texts"),
    "empty rerank stream": (lambda t: t["Rerank"].RerankStream(iter([])), "INVALID_ARGUMENT", "no requests"),
    "three inputs": (
        lambda t: t["Predict"].PredictPair(pb.PredictPairRequest(inputs=["a", "b", "c"])),
        "INVALID_ARGUMENT",
        "pair",
    ),
    "no ids": (lambda t: t["Tokenize"].Decode(pb.DecodeRequest()), "INVALID_ARGUMENT", "ids"),
    "sparse from a dense model": (
        lambda t: t["Embed"].EmbedSparse(pb.EmbedSparseRequest(inputs=TEXT), metadata=_model(EMBEDDER)),
        "INVALID_ARGUMENT",
        "cannot serve embedsparse; it serves: embed, embed_multi_vector",
    ),
    "token embeddings from a sparse model": (
        lambda t: list(t["Embed"].EmbedAllStream(iter([pb.EmbedAllRequest(inputs=TEXT)]), metadata=_model(SPARSE))),
        "INVALID_ARGUMENT",
        "it serves: embed_sparse",
    ),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_calls_get_the_right_code_and_say_why(tei, name):
    call, code, word = BAD_CALLS[name]
    with pytest.raises(grpc.RpcError) as info:
        call(tei)
    assert info.value.code().name == code, info.value.details()
    assert word in info.value.details().lower()


def test_reflection_lists_tei_services(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [reply] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in reply.list_services_response.service}
    assert {f"tei.v1.{s}" for s in ("Info", "Embed", "Predict", "Rerank", "Tokenize")} <= names
