"""Rerank (Cohere / Jina / vLLM, and TEI's on the shared /rerank), classify and score over HTTP against the
session's compat server: every answer equals the native gRPC API's for the same model and inputs, errors
come in the shape of the API the body speaks, and the request id comes back."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import assert_openai_error, assert_tei_error, http, pb, stub  # noqa: F401 (fixtures)
from tests.helpers.compat_server import CLASSIFIER, CROSS, EMBEDDER, GENERATOR

QUERY = "how do I check whether a file is a zip archive"
DOCUMENTS = [
    "zipfile.is_zipfile(filename) returns True if filename is a valid ZIP file.",
    "The tarfile module makes it possible to read and write tar archives.",
    "json.dumps serializes an object to a JSON formatted string.",
    "shutil.make_archive creates an archive file such as zip or tar.",
    "Open a file for reading with open(path, 'rb').",
]


def native_rerank(stub, model, query, documents, **fields):
    request = pb().RerankRequest(model=model, query=query, documents=documents, **fields)
    return stub.Rerank(request, timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
@pytest.mark.parametrize("model", [CROSS, EMBEDDER])
def test_documents_rerank_equals_native(stub, http, path, model):
    """Cohere's body (texts and {text} objects mixed), top_n, documents echoed by default; the cross-encoder
    and the embedder (cosine) both rank as the native Rerank does."""
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]]
    reply = http.post(
        path,
        json={"model": model, "query": QUERY, "documents": documents, "top_n": 3},
        headers={"x-request-id": "rerank-test-1"},
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-request-id"] == "rerank-test-1"
    body = reply.json()
    native = native_rerank(stub, model, QUERY, DOCUMENTS, top_n=3, return_documents=True)
    assert body["id"] == "rerank-rerank-test-1" and body["model"] == model
    assert [r["index"] for r in body["results"]] == [r.index for r in native.results]
    scores = [r["relevance_score"] for r in body["results"]]
    np.testing.assert_allclose(scores, [r.score for r in native.results], atol=1e-6)
    assert [r["document"]["text"] for r in body["results"]] == [r.document for r in native.results]
    assert body["usage"] == {"prompt_tokens": native.usage.prompt_tokens, "total_tokens": native.usage.prompt_tokens}


def test_documents_rerank_options(stub, http):
    """return_documents false leaves documents out; top_n 0 (vLLM's "all") returns every document; raw_scores
    gives the native raw scores."""
    reply = http.post(
        "/v1/rerank",
        json={
            "model": CROSS,
            "query": QUERY,
            "documents": DOCUMENTS,
            "top_n": 0,
            "return_documents": False,
            "raw_scores": True,
        },
    )
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    native = native_rerank(stub, CROSS, QUERY, DOCUMENTS, raw_scores=True)
    assert len(results) == len(DOCUMENTS) and all(set(r) == {"index", "relevance_score"} for r in results)
    np.testing.assert_allclose([r["relevance_score"] for r in results], [r.score for r in native.results], atol=1e-6)


@pytest.mark.parametrize("model", [CROSS, None])
def test_tei_rerank_equals_native(stub, http, model):
    """A TEI body on /rerank gets TEI's answer: [{index, score, text}] best first; no body model, so the
    header picks one, else the first model that reranks (the embedder)."""
    headers = {"x-embedserv-model": model} if model else {}
    reply = http.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True}, headers=headers)
    assert reply.status_code == 200, reply.text
    ranks = reply.json()
    native = native_rerank(stub, model or EMBEDDER, QUERY, DOCUMENTS)
    assert [r["index"] for r in ranks] == [r.index for r in native.results]
    np.testing.assert_allclose([r["score"] for r in ranks], [r.score for r in native.results], atol=1e-6)
    assert [r["text"] for r in ranks] == [DOCUMENTS[r.index] for r in native.results]
    plain = http.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS}, headers=headers).json()
    assert all(set(r) == {"index", "score"} for r in plain)


def test_rerank_chunking_max_equals_native(stub, http):
    """chunking "max" on a Cohere body and a TEI body: the native CHUNKING_MAX scores, the long document
    echoed whole; without it the long document is refused."""
    documents = [DOCUMENTS[0] + " more about zip files" * 200, *DOCUMENTS[1:3]]
    native = native_rerank(stub, CROSS, QUERY, documents, chunking=pb().CHUNKING_MAX).results
    cohere = http.post("/v1/rerank", json={"model": CROSS, "query": QUERY, "documents": documents, "chunking": "max"})
    assert cohere.status_code == 200, cohere.text
    results = cohere.json()["results"]
    assert [(r["index"], r["document"]["text"]) for r in results] == [(r.index, documents[r.index]) for r in native]
    np.testing.assert_allclose([r["relevance_score"] for r in results], [r.score for r in native], atol=1e-6)
    tei = http.post(
        "/rerank", json={"query": QUERY, "texts": documents, "chunking": "max"}, headers={"x-embedserv-model": CROSS}
    ).json()
    assert [r["index"] for r in tei] == [r.index for r in native]
    np.testing.assert_allclose([r["score"] for r in tei], [r.score for r in native], atol=1e-6)
    assert_openai_error(http.post("/v1/rerank", json={"model": CROSS, "query": QUERY, "documents": documents}), 400)


def test_rerank_errors_answer_in_the_body_api_shape(http):
    """On the shared /rerank a TEI body errs as TEI does (422 bad field, 400 empty, 404 unknown model), a
    Cohere body as OpenAI does (400, 404 model_not_found); a body that is not JSON gets OpenAI's 400."""
    assert_tei_error(http.post("/rerank", json={"query": QUERY, "texts": 5}), 422, "validation")
    assert_tei_error(http.post("/rerank", json={"query": QUERY, "texts": []}), 400, "empty")
    assert_tei_error(
        http.post("/rerank", json={"query": QUERY, "texts": ["a"], "truncation_direction": "up"}), 422, "validation"
    )
    assert_tei_error(
        http.post("/rerank", json={"query": QUERY, "texts": ["a"]}, headers={"x-embedserv-model": "nope"}),
        404,
        "validation",
    )
    assert_openai_error(http.post("/rerank", json={"query": QUERY, "documents": 5}), 400, "documents")
    assert_openai_error(http.post("/rerank", json={"query": QUERY, "documents": []}), 400)
    error = assert_openai_error(http.post("/rerank", json={"model": "nope", "query": QUERY, "documents": ["a"]}), 404)
    assert error["code"] == "model_not_found"
    assert_openai_error(http.post("/rerank", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_openai_error(http.post("/v1/rerank", json={"query": 1, "documents": ["a"]}), 400, "query")
    assert_openai_error(http.post("/v1/rerank", json={"model": GENERATOR, "query": QUERY, "documents": ["a"]}), 400)


def test_classify_equals_native(stub, http):
    """vLLM's classify: probs in the model's label order, the best label, num_classes, usage."""
    texts = ["I love this library", "this is terrible", "the weather is mild"]
    reply = http.post("/v1/classify", json={"model": CLASSIFIER, "input": texts}, headers={"x-request-id": "cls-1"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    native = stub.Classify(pb().ClassifyRequest(model=CLASSIFIER, inputs=texts), timeout=RPC_TIMEOUT_S)
    assert body["id"] == "classify-cls-1" and body["object"] == "list" and body["model"] == CLASSIFIER
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for data, classification in zip(body["data"], native.classifications, strict=True):
        np.testing.assert_allclose(data["probs"], [s.score for s in classification.scores], atol=1e-6)
        assert data["label"] == classification.label and data["num_classes"] == 3
    assert body["usage"]["prompt_tokens"] == native.usage.prompt_tokens
    one = http.post("/v1/classify", json={"model": CLASSIFIER, "input": texts[0]}).json()
    np.testing.assert_allclose(one["data"][0]["probs"], body["data"][0]["probs"], atol=1e-6)


def test_classify_errors(http):
    assert_openai_error(http.post("/v1/classify", json={"model": CLASSIFIER, "input": 5}), 400, "input")
    assert_openai_error(http.post("/v1/classify", json={"model": CLASSIFIER, "input": []}), 400)
    assert_openai_error(http.post("/v1/classify", json={"model": "nope", "input": "a"}), 404)
    assert_openai_error(http.post("/v1/classify", json={"model": EMBEDDER, "input": "a"}), 400)


@pytest.mark.parametrize("model", [CROSS, EMBEDDER])
def test_score_equals_native(stub, http, model):
    """vLLM's score, 1:N and N:N, in pair order: a cross-encoder's scores and an embedder's cosine are the
    native Rerank's scores of each pair."""
    reply = http.post("/v1/score", json={"model": model, "text_1": QUERY, "text_2": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == model and body["id"].startswith("score-")
    native = native_rerank(stub, model, QUERY, DOCUMENTS)
    by_index = {r.index: r.score for r in native.results}
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert all(d["object"] == "score" for d in body["data"])
    np.testing.assert_allclose(
        [d["score"] for d in body["data"]], [by_index[i] for i in range(len(DOCUMENTS))], atol=1e-6
    )
    firsts = [QUERY, "json serialization", QUERY]
    pairwise = http.post("/v1/score", json={"model": model, "text_1": firsts, "text_2": DOCUMENTS[:3]}).json()
    expected = [native_rerank(stub, model, a, [b]).results[0].score for a, b in zip(firsts, DOCUMENTS[:3], strict=True)]
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], expected, atol=1e-6)


def test_score_of_embedder_is_cosine(stub, http):
    texts = [QUERY, DOCUMENTS[0]]
    embeddings = stub.Embed(pb().EmbedRequest(model=EMBEDDER, inputs=texts), timeout=RPC_TIMEOUT_S).embeddings
    a, b = (np.asarray(e.values) for e in embeddings)
    cosine = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    reply = http.post("/v1/score", json={"model": EMBEDDER, "text_1": [QUERY], "text_2": DOCUMENTS[0]})
    assert reply.json()["data"][0]["score"] == pytest.approx(cosine, abs=1e-5)


def test_score_errors(http):
    mismatched = {"model": CROSS, "text_1": ["a", "b"], "text_2": ["c"] * 3}
    error = assert_openai_error(http.post("/v1/score", json=mismatched), 400)
    assert "pairwise" in error["message"]
    assert_openai_error(http.post("/v1/score", json={"model": CROSS, "text_1": "a", "text_2": []}), 400)
    assert_openai_error(http.post("/v1/score", json={"model": CROSS, "text_1": {"a": 1}, "text_2": "b"}), 400, "text_1")
    assert_openai_error(http.post("/v1/score", json={"model": CLASSIFIER, "text_1": "a", "text_2": "b"}), 400)


def test_openapi_describes_the_routes(http):
    doc = http.get("/openapi.json").json()
    for path in ("/v1/rerank", "/v1/classify", "/v1/score"):
        assert "requestBody" in doc["paths"][path]["post"]
    shared = doc["paths"]["/rerank"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    assert [sorted(s["required"]) for s in shared] == [["documents", "query"], ["query", "texts"]]
