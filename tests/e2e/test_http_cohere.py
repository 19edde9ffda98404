"""Cohere's v2 API (/v2/embed, /v2/rerank) through the cohere SDK's ClientV2 against the session's compat server:
each embedding type is gRPC Embed's bytes in that encoding, rerank is gRPC Rerank's order and scores, and bad input
is the SDK's BadRequestError. A model's input_types pick the prompt an input_type embeds with (a server of its own:
MiniLM with prompts)."""

from __future__ import annotations

import base64

import cohere
import httpx
import numpy as np
import pytest

from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import http, pb, stub  # noqa: F401 (fixtures)
from tests.helpers.compat_server import CROSS, EMBEDDER
from tests.helpers.inprocess import in_process_server
from tests.helpers.prompted_models import prompted_minilm
from tests.helpers.server import free_port

TEXTS = ["Hello World, this is Cohere v2!", "zipfile.is_zipfile checks a ZIP archive", "naïve café ☕"]
RAW = {"int8": ("INT8", np.int8), "uint8": ("UINT8", np.uint8), "binary": ("BINARY", np.int8),
       "ubinary": ("UBINARY", np.uint8)}  # fmt: skip


@pytest.fixture(scope="module")
def client(compat_server):
    return cohere.ClientV2(base_url=compat_server.http, api_key="unused", timeout=RPC_TIMEOUT_S)


def _grpc_raw(stub, encoding: str, **fields) -> list[bytes]:
    request = pb().EmbedRequest(model=EMBEDDER, inputs=TEXTS, encoding=pb().Encoding.Value(f"ENCODING_{encoding}"),
                                truncate=True, **fields)  # fmt: skip
    return [e.raw for e in stub.Embed(request, timeout=RPC_TIMEOUT_S).embeddings]


def test_every_embedding_type_is_grpcs_encoding(client, stub):
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    reply = client.embed(model=EMBEDDER, texts=TEXTS, input_type="search_document", embedding_types=types)
    floats = np.array(reply.embeddings.float_, dtype="<f4")
    np.testing.assert_array_equal(floats, [np.frombuffer(r, "<f4") for r in _grpc_raw(stub, "BYTES")])
    assert [base64.b64decode(b) for b in reply.embeddings.base64] == [row.tobytes() for row in floats]
    for kind, (encoding, dtype) in RAW.items():
        codes = np.array(getattr(reply.embeddings, kind), dtype=dtype)
        np.testing.assert_array_equal(codes, [np.frombuffer(r, dtype) for r in _grpc_raw(stub, encoding)], kind)
    assert reply.texts == TEXTS and reply.meta.billed_units.input_tokens > 0


def test_output_dimension_and_truncation(client, stub):
    reply = client.embed(model=EMBEDDER, texts=TEXTS, input_type="search_query", embedding_types=["float"],
                         output_dimension=64)  # fmt: skip
    want = [np.frombuffer(r, "<f4") for r in _grpc_raw(stub, "BYTES", dimensions=64)]
    np.testing.assert_array_equal(np.array(reply.embeddings.float_, dtype="<f4"), want)
    long_text = " ".join(["word"] * 600) + " end"
    start = client.embed(model=EMBEDDER, texts=[long_text], input_type="search_query", embedding_types=["float"],
                         truncate="START")  # fmt: skip
    left = pb().EmbedRequest(model=EMBEDDER, inputs=[long_text], truncate=True, encoding=pb().ENCODING_BYTES,
                             truncation_direction=pb().TRUNCATION_DIRECTION_LEFT)  # fmt: skip
    expected = np.frombuffer(stub.Embed(left, timeout=RPC_TIMEOUT_S).embeddings[0].raw, "<f4")
    np.testing.assert_array_equal(np.array(start.embeddings.float_[0], dtype="<f4"), expected)
    with pytest.raises(cohere.BadRequestError):
        client.embed(model=EMBEDDER, texts=[long_text], input_type="search_query", embedding_types=["float"],
                     truncate="NONE")  # fmt: skip


def test_rerank_is_grpcs(client, stub):
    query, documents = TEXTS[1], ["The zipfile module reads ZIP archives", "A recipe for bread", TEXTS[2]]
    native = stub.Rerank(pb().RerankRequest(model=CROSS, query=query, documents=documents), timeout=RPC_TIMEOUT_S)
    reply = client.rerank(model=CROSS, query=query, documents=documents, top_n=2)
    assert [r.index for r in reply.results] == [r.index for r in native.results[:2]]
    np.testing.assert_allclose([r.relevance_score for r in reply.results], [r.score for r in native.results[:2]],
                               atol=1e-6)  # fmt: skip


def test_bad_input_is_the_sdks_bad_request(client):
    with pytest.raises(cohere.BadRequestError):
        client.embed(model=EMBEDDER, texts=[], input_type="search_query", embedding_types=["float"])
    with pytest.raises(cohere.BadRequestError):
        client.embed(model=EMBEDDER, images=["https://example.com/a.png"], input_type="image",
                     embedding_types=["float"])  # fmt: skip
    with pytest.raises(cohere.NotFoundError):
        client.embed(model="nope", texts=TEXTS, input_type="search_query", embedding_types=["float"])


def test_errors_are_in_cohere_shape(http):
    """Cohere's {"message"} with the status the SDK maps: 400 for a bad body or input, 404 for an unknown model."""
    bodies = [
        ({"texts": [], "embedding_types": ["float"]}, 400),
        ({"texts": "a"}, 400),
        ({"texts": ["a"], "embedding_types": ["float64"]}, 400),
        ({"model": "nope", "texts": ["a"]}, 404),
    ]
    for body, status in bodies:
        reply = http.post("/v2/embed", json=body)
        assert reply.status_code == status and set(reply.json()) == {"message"} and reply.json()["message"], body
    reply = http.post("/v2/rerank", json={"query": "q"})
    assert reply.status_code == 400 and "documents" in reply.json()["message"]


PROMPTED = "minilm-prompted"


@pytest.fixture(scope="module")
def prompted_http(tmp_path_factory):
    """A server of MiniLM with query, passage and topic prompts, its --config entry mapping search_query to topic
    (over the default, the query prompt) and clustering to query (no default)."""
    root = tmp_path_factory.mktemp("prompted")
    model = prompted_minilm(root, {"query": "query: ", "passage": "passage: ", "topic": "topic: "})
    config = root / "embedserv.yaml"
    config.write_text(
        f"models:\n  - path: {model}\n    served_name: {PROMPTED}\n"
        "    input_types: {search_query: topic, clustering: query}\n"
    )
    port = free_port()
    with in_process_server(["--config", str(config), "--dtype", "float32", "--http-port", str(port)]):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=RPC_TIMEOUT_S) as client:
            yield client


def test_input_type_embeds_with_the_configured_prompt(prompted_http):
    """Each input_type's vectors are TEI /embed's with its prompt: configured, else the default."""

    def by_input_type(input_type: str) -> np.ndarray:
        body = {"model": PROMPTED, "texts": TEXTS, "input_type": input_type, "embedding_types": ["float"]}
        reply = prompted_http.post("/v2/embed", json=body)
        assert reply.status_code == 200, reply.text
        return np.array(reply.json()["embeddings"]["float"])

    def by_prompt(prompt: str | None) -> np.ndarray:
        return np.array(prompted_http.post("/embed", json={"inputs": TEXTS, "prompt_name": prompt}).json())

    expected = {"search_query": "topic", "clustering": "query", "search_document": "passage", "classification": None}
    for input_type, prompt in expected.items():
        np.testing.assert_allclose(by_input_type(input_type), by_prompt(prompt), atol=1e-6, err_msg=input_type)
    assert not np.allclose(by_prompt("topic"), by_prompt("query"), atol=1e-3), "the prompts should change the vectors"
