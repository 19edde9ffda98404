"""text-embeddings-inference's HTTP API (/embed, /embed_sparse, /embed_all, /similarity, /predict, /tokenize,
/decode, /info, /health) against the session's compat server: TEI's request fields and defaults, TEI's answer
shapes holding the native gRPC API's numbers, and TEI's error shape and statuses."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.helpers.client import RPC_TIMEOUT_S, response_matrix
from tests.helpers.compat_http import assert_tei_error, http, pb, stub  # noqa: F401 (fixtures)
from tests.helpers.compat_server import CLASSIFIER, CROSS, EMBEDDER, GENERATOR, MAX_CLIENT_BATCH, SPARSE

TEXTS = ["Hello World, this is TEI!", "zipfile.is_zipfile checks a ZIP archive", "naïve café ☕"]


def model_header(name: str) -> dict:
    return {"x-embedserv-model": name}


def native_embed(stub, texts, **fields) -> np.ndarray:
    request = pb().EmbedRequest(model=EMBEDDER, inputs=texts, **fields)
    return response_matrix(stub.Embed(request, timeout=RPC_TIMEOUT_S))


def test_embed_equals_native(stub, http):
    """TEI's defaults (normalize true) and options; one text is a batch of one; the first embedder serves."""
    reply = http.post("/embed", json={"inputs": TEXTS}, headers={"x-request-id": "tei-embed-1"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-request-id"] == "tei-embed-1"
    np.testing.assert_allclose(reply.json(), native_embed(stub, TEXTS), atol=1e-6)
    one = http.post("/embed", json={"inputs": TEXTS[0]}).json()
    np.testing.assert_allclose(one, native_embed(stub, TEXTS[:1]), atol=1e-6)
    options = {"normalize": False, "dimensions": 64}
    raw = http.post("/embed", json={"inputs": TEXTS, **options}).json()
    np.testing.assert_allclose(raw, native_embed(stub, TEXTS, **options), atol=1e-6)
    long_text = " ".join(["word"] * 600)
    left = http.post("/embed", json={"inputs": [long_text + " end"], "truncate": True, "truncation_direction": "LEFT"})
    native = native_embed(
        stub, [long_text + " end"], truncate=True, truncation_direction=pb().TRUNCATION_DIRECTION_LEFT
    )
    np.testing.assert_allclose(left.json(), native, atol=1e-6)


def test_embed_token_ids(stub, http):
    """Token-id inputs, alone or beside texts, embed as the texts they tokenize from."""
    tokens = stub.Tokenize(pb().TokenizeRequest(model=EMBEDDER, inputs=TEXTS[:2]), timeout=RPC_TIMEOUT_S)
    ids = [[t.id for t in x.tokens] for x in tokens.inputs]
    expected = native_embed(stub, TEXTS[:2])
    np.testing.assert_allclose(http.post("/embed", json={"inputs": ids[0]}).json(), expected[:1], atol=1e-5)
    mixed = http.post("/embed", json={"inputs": [TEXTS[0], ids[1]]}).json()
    np.testing.assert_allclose(mixed, expected, atol=1e-5)


def test_embed_all_and_embed_sparse_equal_native(stub, http):
    """/embed_all: each input's token vectors, the native EmbedMultiVector's (the first model with them:
    MiniLM's last hidden states); /embed_sparse: TEI's [{index, value}] per input, the native EmbedSparse's
    (the first sparse model), token-id inputs beside texts; a model without the output is TEI's 422."""
    request = pb().EmbedMultiVectorRequest(model=EMBEDDER, inputs=TEXTS)
    native = [
        np.frombuffer(m.raw, "<f4").reshape(m.num_vectors, m.dimension)
        for m in stub.EmbedMultiVector(request, timeout=RPC_TIMEOUT_S).embeddings
    ]
    reply = http.post("/embed_all", json={"inputs": TEXTS})
    assert reply.status_code == 200, reply.text
    for got, want in zip(reply.json(), native, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.asarray(http.post("/embed_all", json={"inputs": TEXTS[0]}).json()).shape == (1, *native[0].shape)

    sparse = stub.EmbedSparse(pb().EmbedSparseRequest(model=SPARSE, inputs=TEXTS), timeout=RPC_TIMEOUT_S).embeddings
    tokenized = stub.Tokenize(pb().TokenizeRequest(model=SPARSE, inputs=TEXTS[1:2]), timeout=RPC_TIMEOUT_S)
    ids = [t.id for t in tokenized.inputs[0].tokens]
    reply = http.post("/embed_sparse", json={"inputs": [TEXTS[0], ids]})
    assert reply.status_code == 200, reply.text
    for got, want in zip(reply.json(), sparse[:2], strict=True):
        assert set(got[0]) == {"index", "value"} and [x["index"] for x in got] == list(want.indices)
        np.testing.assert_allclose([x["value"] for x in got], want.values, atol=1e-6)
    assert "cannot serve EmbedSparse; it serves: embed, embed_multi_vector" in assert_tei_error(
        http.post("/embed_sparse", json={"inputs": "a"}, headers=model_header(EMBEDDER)), 422
    )
    assert "it serves: embed_sparse" in assert_tei_error(
        http.post("/embed_all", json={"inputs": "a"}, headers=model_header(SPARSE)), 422
    )


def test_similarity_is_the_cosine_of_embed(http):
    """TEI's documented example: a list of floats, one per sentence, in order; each the cosine of the source
    sentence's /embed vector with the sentence's; parameters pass through as /embed's fields do."""
    body = {"inputs": {"source_sentence": "What is Deep Learning?", "sentences": ["What is Machine Learning?"]}}
    reply = http.post("/similarity", json=body)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()) == 1 and isinstance(reply.json()[0], float)
    source, sentences = TEXTS[0], [TEXTS[1], TEXTS[0], "naïve café"]
    vectors = np.asarray(http.post("/embed", json={"inputs": [source, *sentences]}).json())
    got = http.post("/similarity", json={"inputs": {"source_sentence": source, "sentences": sentences}}).json()
    np.testing.assert_allclose(got, vectors[1:] @ vectors[0], atol=1e-5)
    assert got[1] == pytest.approx(1.0, abs=1e-5)
    long_text = " ".join(["word"] * 600)
    parameters = {"truncate": True, "truncation_direction": "Left", "prompt_name": None}
    cut = http.post("/similarity", json={"inputs": {"source_sentence": long_text, "sentences": [TEXTS[1]]},
                                         "parameters": parameters})  # fmt: skip
    assert cut.status_code == 200, cut.text
    left = {"inputs": [long_text, TEXTS[1]], "truncate": True, "truncation_direction": "left"}
    vectors = np.asarray(http.post("/embed", json=left).json())
    np.testing.assert_allclose(cut.json(), [vectors[1] @ vectors[0]], atol=1e-5)


def test_the_root_route_takes_inference_clients_similarity_body(http):
    """huggingface_hub's InferenceClient(model=URL).sentence_similarity posts this body to the URL itself (as
    huggingface_hub 2.4 sends it; the client cannot be used here: HF_HUB_OFFLINE blocks its every request)."""
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}, "parameters": {}}
    reply = http.post("/", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json() == http.post("/similarity", json=body).json()


def test_similarity_errors_in_tei_shape(http):
    """No sentences is TEI's 400 empty; a body without source_sentence, a long text without truncate, an unknown
    prompt and a batch past --max-client-batch-size (the source sentence counted) are 422."""

    def inputs(**fields):
        return {"inputs": {"source_sentence": "a", "sentences": ["b"], **fields}}

    assert "inputs.sentences" in assert_tei_error(http.post("/similarity", json=inputs(sentences=[])), 400, "empty")
    assert "source_sentence" in assert_tei_error(http.post("/similarity", json={"inputs": {"sentences": ["b"]}}), 422)
    assert_tei_error(http.post("/similarity", json={"source_sentence": "a", "sentences": ["b"]}), 422)
    assert_tei_error(http.post("/similarity", json=inputs(sentences="b")), 422)
    assert_tei_error(http.post("/similarity", json=inputs(source_sentence=" ".join(["word"] * 600))), 422)
    assert_tei_error(http.post("/similarity", json={**inputs(), "parameters": {"prompt_name": "nope"}}), 422)
    many = inputs(sentences=["b"] * MAX_CLIENT_BATCH)
    assert "max-client-batch-size" in assert_tei_error(http.post("/similarity", json=many), 422)
    assert_tei_error(http.post("/similarity", json=inputs(), headers=model_header(CROSS)), 422)


def test_predict_equals_native(stub, http):
    """Labels best first: a list for one input, a list per input for a batch; a pair is a cross-encoder's
    score of the pair (the native Rerank's)."""
    native = stub.Classify(pb().ClassifyRequest(model=CLASSIFIER, inputs=TEXTS), timeout=RPC_TIMEOUT_S)
    expected = [sorted(((s.score, s.label) for s in c.scores), reverse=True) for c in native.classifications]
    headers = model_header(CLASSIFIER)
    one = http.post("/predict", json={"inputs": TEXTS[0]}, headers=headers)
    assert one.status_code == 200, one.text
    assert [p["label"] for p in one.json()] == [label for _, label in expected[0]]
    np.testing.assert_allclose([p["score"] for p in one.json()], [s for s, _ in expected[0]], atol=1e-6)
    batch = http.post("/predict", json={"inputs": [[t] for t in TEXTS]}, headers=headers).json()
    for got, want in zip(batch, expected, strict=True):
        assert [p["label"] for p in got] == [label for _, label in want]
        np.testing.assert_allclose([p["score"] for p in got], [s for s, _ in want], atol=1e-6)

    query, document = TEXTS[1], "The zipfile module reads and writes ZIP archives"
    rerank = stub.Rerank(pb().RerankRequest(model=CROSS, query=query, documents=[document]), timeout=RPC_TIMEOUT_S)
    pair = http.post("/predict", json={"inputs": [query, document]}).json()  # the first cross-encoder
    assert len(pair) == 1 and pair[0]["score"] == pytest.approx(rerank.results[0].score, abs=1e-6)
    mixed = http.post("/predict", json={"inputs": [[query, document], [TEXTS[0]]]}, headers=model_header(CROSS)).json()
    assert mixed[0][0]["score"] == pytest.approx(rerank.results[0].score, abs=1e-6) and len(mixed[1]) == 1


def test_tokenize_equals_native(stub, http):
    """Ids and special flags as the native Tokenize's; a token's text is the input it covers and its offsets
    are the native character offsets in UTF-8 bytes (as TEI's); special tokens carry their own text and no
    offsets."""
    for add_special in (True, False):
        reply = http.post(
            "/tokenize", json={"inputs": TEXTS, "add_special_tokens": add_special}, headers=model_header(EMBEDDER)
        )
        assert reply.status_code == 200, reply.text
        request = pb().TokenizeRequest(model=EMBEDDER, inputs=TEXTS, add_special_tokens=add_special)
        native = stub.Tokenize(request, timeout=RPC_TIMEOUT_S)
        for text, got, want in zip(TEXTS, reply.json(), native.inputs, strict=True):
            assert [t["id"] for t in got] == [t.id for t in want.tokens]
            assert [t["special"] for t in got] == [t.special for t in want.tokens]
            assert any(t["special"] for t in got) == add_special
            for token, native_token in zip(got, want.tokens, strict=True):
                if token["special"]:
                    assert token["text"] == native_token.text and token["start"] is token["stop"] is None
                else:
                    assert token["text"] == text[native_token.start : native_token.end]
                    start = len(text[: native_token.start].encode())
                    assert (token["start"], token["stop"]) == (start, start + len(token["text"].encode()))
    one = http.post("/tokenize", json={"inputs": TEXTS[0]}).json()
    assert len(one) == 1 and one[0][0]["text"] == "[CLS]"


def test_decode_equals_tokenizer(compat_server, http):
    tokenizer = Tokenizer.from_file(str(compat_server.models[EMBEDDER] / "tokenizer.json"))
    ids = [tokenizer.encode(t).ids for t in TEXTS]
    reply = http.post("/decode", json={"ids": ids}, headers=model_header(EMBEDDER))
    assert reply.status_code == 200, reply.text
    assert reply.json() == [tokenizer.decode(x) for x in ids]
    kept = http.post("/decode", json={"ids": ids[0], "skip_special_tokens": False}).json()
    assert kept == [tokenizer.decode(ids[0], skip_special_tokens=False)] and kept[0].startswith("[CLS]")


def test_info_describes_each_model(stub, http):
    models = {m.name: m for m in stub.ListModels(pb().ListModelsRequest(), timeout=RPC_TIMEOUT_S).models}
    info = http.get("/info").json()
    assert info["model_id"] == EMBEDDER and info["model_type"] == {"embedding": {"pooling": models[EMBEDDER].pooling}}
    assert info["max_input_length"] == models[EMBEDDER].max_input_tokens
    assert info["max_client_batch_size"] == MAX_CLIENT_BATCH and info["auto_truncate"] is False
    labels = list(models[CLASSIFIER].labels)
    classifier = http.get("/info", headers=model_header(CLASSIFIER)).json()["model_type"]
    assert classifier == {
        "classifier": {
            "id2label": {str(i): x for i, x in enumerate(labels)},
            "label2id": {x: i for i, x in enumerate(labels)},
        }
    }
    assert list(http.get("/info", headers=model_header(CROSS)).json()["model_type"]) == ["reranker"]
    assert list(http.get("/info", headers=model_header(GENERATOR)).json()["model_type"]) == ["embedding"]


def test_health(http):
    reply = http.get("/health")
    assert reply.status_code == 200 and reply.content == b""


def test_errors_in_tei_shape(http):
    """Empty batch 400, bad field types and limits 422, unknown model 404, TEI's shape."""
    assert_tei_error(http.post("/embed", json={"inputs": []}), 400, "empty")
    assert_tei_error(http.post("/embed", json={"inputs": 5}), 422)
    assert_tei_error(http.post("/embed", json={"inputs": "a", "normalize": "maybe"}), 422)
    assert_tei_error(http.post("/embed", json={"inputs": "a", "truncation_direction": "middle"}), 422)
    assert_tei_error(http.post("/embed", json={"inputs": "a", "prompt_name": "nope"}), 422)
    assert "max-client-batch-size" in assert_tei_error(http.post("/embed", json={"inputs": ["a"] * 33}), 422)
    assert_tei_error(http.post("/embed", json={"inputs": "a"}, headers=model_header("nope")), 404)
    assert_tei_error(http.post("/predict", json={"inputs": ["a", "b", "c"]}), 422)
    assert_tei_error(http.post("/predict", json={"inputs": ["a", "b"]}, headers=model_header(CLASSIFIER)), 422)
    assert_tei_error(http.post("/tokenize", json={"inputs": []}), 400, "empty")
    assert_tei_error(http.post("/decode", json={"ids": [[10**9]]}), 422)
    assert_tei_error(http.post("/decode", json={"ids": "abc"}), 422)
    assert_tei_error(http.post("/embed_all", json={"inputs": []}), 400, "empty")


def test_the_root_route_serves_the_models_own_task(http):
    """POST / (what huggingface_hub's InferenceClient and LangChain's HuggingFaceEndpointEmbeddings call) is
    /embed for an embedder, /embed_sparse for a sparse model, /predict for a classifier and /rerank for a
    cross-encoder: the header's model, else the first served; TEI's errors."""
    texts = {"inputs": TEXTS}
    assert http.post("/", json=texts).json() == http.post("/embed", json=texts).json()
    sparse = model_header(SPARSE)
    assert http.post("/", json=texts, headers=sparse).json() == http.post("/embed_sparse", json=texts).json()
    labels = model_header(CLASSIFIER)
    one = {"inputs": TEXTS[0]}
    assert http.post("/", json=one, headers=labels).json() == http.post("/predict", json=one, headers=labels).json()
    pairs = {"query": TEXTS[1], "texts": TEXTS}
    cross = model_header(CROSS)
    assert http.post("/", json=pairs, headers=cross).json() == http.post("/rerank", json=pairs, headers=cross).json()
    assert_tei_error(http.post("/", json={"inputs": 5}), 422)
    assert_tei_error(http.post("/", json={"query": "q"}, headers=cross), 422)
    assert_tei_error(http.post("/", content=b"[1]", headers={"content-type": "application/json"}), 422)
    assert_tei_error(http.post("/", json=texts, headers=model_header("nope")), 404)


def test_sagemakers_contract_and_the_root_health(http):
    """SageMaker's POST /invocations is the root route (a rerank body reranks, whatever the first model does);
    GET /ping and GET / are /health."""
    texts = {"inputs": TEXTS}
    assert http.post("/invocations", json=texts).json() == http.post("/embed", json=texts).json()
    pairs = {"query": TEXTS[1], "texts": TEXTS}
    assert http.post("/invocations", json=pairs).json() == http.post("/rerank", json=pairs).json()
    for path in ("/ping", "/"):
        reply = http.get(path)
        assert reply.status_code == 200 and reply.content == b"", path
