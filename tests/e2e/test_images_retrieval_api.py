"""Page images over the faces of a server with a tiny random-weight ColQwen2 (tests/helpers/vision_language_models.py):
gRPC EmbedMultiVector (queries and page images in one call) and Rerank of document_images, the Python client and
the CLI give what Engine.embed / Engine.rerank give for the same inputs; misuse is refused naming the input."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from embedserv.types import EmbedOutput, EmbedParams, ImageInput, RerankParams
from embedserv_client import Client, cli
from tests.helpers.client import RPC_TIMEOUT_S, inference_stub
from tests.helpers.images import truncated_png
from tests.helpers.inprocess import in_process_server
from tests.helpers.vision_language_models import build_tiny_colqwen2, page_image

MODEL = "tiny-colqwen2"
QUERIES = ["what is a socket", "how to parse json files"]
PAGES = [page_image(56, 84, seed=0), page_image(84, 112, seed=1, fmt="JPEG"), page_image(56, 56, seed=2)]
ATOL = 1e-5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_tiny_colqwen2(tmp_path_factory.mktemp("colqwen2"))
    args = ["--model", str(model_dir), "--served-model-name", MODEL, "--dtype", "float32", "--device", "cpu"]
    with in_process_server(args) as (target, handle):
        with grpc.insecure_channel(target) as channel:
            yield target, handle, inference_stub(channel)


def _pb():
    from embedserv.v1 import embedserv_pb2

    return embedserv_pb2


def _engine_call(served, method: str, *args):
    engine = served[1].server.frontend.models.get(MODEL)
    service = {"embed": engine.embedding.embed, "rerank": engine.reranking.rerank}[method]
    return served[1].call(service(*args), RPC_TIMEOUT_S)


def _engine_vectors(served, queries: list[str], pages: list[bytes]) -> list[np.ndarray]:
    params = EmbedParams(outputs=(EmbedOutput.MULTI_VECTOR,))
    return _engine_call(served, "embed", queries + [ImageInput(p) for p in pages], params).multi_vectors


def _vectors(reply) -> list[np.ndarray]:
    return [np.frombuffer(m.raw, "<f4").reshape(m.num_vectors, m.dimension) for m in reply.embeddings]


def _assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_list_models_says_pages_and_token_vectors(served):
    (model,) = served[2].ListModels(_pb().ListModelsRequest(), timeout=RPC_TIMEOUT_S).models
    assert list(model.modalities) == ["text", "image"] and model.max_image_bytes == 8 * 2**20
    assert _pb().OUTPUT_MULTI_VECTOR in model.outputs


def test_embed_multi_vector_queries_then_pages_equal_engine_embed(served):
    request = _pb().EmbedMultiVectorRequest(model=MODEL, inputs=QUERIES, images=PAGES)
    reply = served[2].EmbedMultiVector(request, timeout=RPC_TIMEOUT_S)
    _assert_same(_vectors(reply), _engine_vectors(served, QUERIES, PAGES))


def test_rerank_of_document_images_equals_engine_rerank(served):
    expected = _engine_call(served, "rerank", QUERIES[0], [ImageInput(p) for p in PAGES], RerankParams())
    request = _pb().RerankRequest(model=MODEL, query=QUERIES[0], document_images=PAGES, return_documents=True)
    reply = served[2].Rerank(request, timeout=RPC_TIMEOUT_S)
    assert [r.index for r in reply.results] == [r.index for r in expected.results]
    np.testing.assert_allclose([r.score for r in reply.results], [r.score for r in expected.results], rtol=1e-5)
    assert all(r.document == "" for r in reply.results)  # images are never echoed


def test_client_and_cli_send_page_images(served, tmp_path, capsys):
    paths = []
    for index, page in enumerate(PAGES):
        paths.append(tmp_path / f"page{index}.png")
        paths[-1].write_bytes(page)
    with Client(served[0], model=MODEL) as client:
        _assert_same(client.embed_multi_vector(QUERIES, images=paths), _engine_vectors(served, QUERIES, PAGES))
        ranked = client.rerank(QUERIES[1], document_images=[str(p) for p in paths], top_n=2)
    expected = _engine_call(served, "rerank", QUERIES[1], [ImageInput(p) for p in PAGES], RerankParams(top_n=2))
    assert [(r.index, r.document) for r in ranked] == [(r.index, None) for r in expected.results]
    args = ["--target", served[0], "--model", MODEL, "rerank", QUERIES[1]]
    assert cli.main(args + [arg for p in paths for arg in ("--document-image", str(p))]) == 0
    printed = json.loads(capsys.readouterr().out)["results"]
    assert [r["document"] for r in printed[:2]] == [str(paths[r.index]) for r in expected.results]


def _refused(call, request) -> str:
    with pytest.raises(grpc.RpcError) as error:
        call(request, timeout=RPC_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    return error.value.details()


def test_misuse_is_refused_naming_the_input(served):
    stub = served[2]
    request = _pb().EmbedMultiVectorRequest(model=MODEL, inputs=QUERIES, images=[PAGES[0], truncated_png()])
    assert "input 3" in _refused(stub.EmbedMultiVector, request)  # the second image, after two queries
    request = _pb().RerankRequest(model=MODEL, query="q", documents=["a page"], document_images=PAGES[:1])
    assert "send documents or document_images, not both" in _refused(stub.Rerank, request)
    assert "inputs and images are both empty" in _refused(stub.EmbedMultiVector, _pb().EmbedMultiVectorRequest())
    reply = stub.EmbedMultiVector(_pb().EmbedMultiVectorRequest(model=MODEL, images=PAGES[:1]), timeout=RPC_TIMEOUT_S)
    _assert_same(_vectors(reply), _engine_vectors(served, [], PAGES[:1]))
