"""Images over every face of a server with a tiny random-weight CLIP (tests/helpers/vision_models.py) in two
data-parallel worker processes: gRPC items, the OpenAI content parts and messages form (raw HTTP and the openai
SDK), the Python client and CLI all give Engine.embed's vectors for the same texts and images; bad images and
limits are refused with INVALID_ARGUMENT / 400 naming the input; a seeded fuzz of random bytes as images never
takes a worker down; and both workers answer image calls. (The text-only model's refusals:
test_images_text_only.py.)"""

from __future__ import annotations

import asyncio
import base64
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import openai
import pytest

from embedserv.types import EmbedParams, ImageInput
from embedserv_client import Client, cli
from tests.helpers.client import RPC_TIMEOUT_S, response_matrix
from tests.helpers.compat_http import pb as _pb
from tests.helpers.images import huge_png_header, jpeg_bytes, png_bytes, random_image, truncated_png, webp_bytes
from tests.helpers.inprocess import in_process_http_server
from tests.helpers.served_fixtures import http, target  # noqa: F401 (fixtures)
from tests.helpers.vision_models import save_dual_encoder

CLIP = "tiny-clip"
MAX_IMAGES = 4
MAX_BATCH = 6
MAX_BYTES = 200_000
WORKERS = 2
ATOL = 1e-5
PNG = png_bytes(random_image(1, 32, 32))
JPEG = jpeg_bytes(random_image(2, 50, 40))
WEBP = webp_bytes(random_image(3, 64, 20))
ITEMS = ["a photo of a cat", PNG, "a page of text", JPEG, WEBP]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = save_dual_encoder(tmp_path_factory.mktemp("clip") / "clip", "clip")
    args = [
        "--model",
        str(model_dir),
        "--served-model-name",
        CLIP,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--data-parallel-size",
        str(WORKERS),
        "--max-images-per-request",
        str(MAX_IMAGES),
        "--max-image-bytes",
        str(MAX_BYTES),
        "--max-client-batch-size",
        str(MAX_BATCH),
    ]
    with in_process_http_server(args, worker_processes=True) as served:
        yield served


def _engine(served):
    return served[2].server.frontend.models.get(CLIP)


def _worker_stats(served):
    return [worker.stats() for worker in served[2].server.host.cores[CLIP].workers]


def _engine_embed(served, items: list) -> np.ndarray:
    """Engine.embed of the same inputs, run on the server's own loop."""
    inputs = [ImageInput(x) if isinstance(x, bytes) else x for x in items]
    return served[2].call(_engine(served).embedding.embed(inputs, EmbedParams()), RPC_TIMEOUT_S).embeddings


def _grpc_items(items: list) -> list:
    pb = _pb()
    return [pb.InputItem(image=x) if isinstance(x, bytes) else pb.InputItem(text=x) for x in items]


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _part(item) -> dict | str:
    if isinstance(item, bytes):
        return {"type": "image_url", "image_url": {"url": _data_url(item)}}
    return item


def test_list_models_reports_the_image_modality_and_limits(stub, http):
    reply = stub.ListModels(_pb().ListModelsRequest(), timeout=RPC_TIMEOUT_S)
    (model,) = reply.models
    assert list(model.modalities) == ["text", "image"]
    assert (model.max_image_bytes, model.max_image_pixels) == (MAX_BYTES, 40_000_000)
    assert reply.limits.max_images_per_request == MAX_IMAGES
    # The receive limit has room for a full call's images (in base64 over HTTP) beside its texts.
    texts = (MAX_BATCH + 1) * (100_000 * 4 + 16) + 64 * 1024
    assert reply.limits.max_receive_message_bytes == texts + MAX_IMAGES * (MAX_BYTES * 4 // 3 + 64)
    assert http.get("/v1/models").json()["data"][0]["modalities"] == ["text", "image"]


def test_grpc_items_mixing_texts_and_image_sizes_equal_engine_embed(served, stub):
    expected = _engine_embed(served, ITEMS)
    assert expected.shape[0] == len(ITEMS)
    reply = stub.Embed(_pb().EmbedRequest(model=CLIP, items=_grpc_items(ITEMS)), timeout=RPC_TIMEOUT_S)
    np.testing.assert_allclose(response_matrix(reply), expected, atol=ATOL)
    requests = [_pb().EmbedRequest(model=CLIP, items=_grpc_items(ITEMS[i : i + 2])) for i in range(0, len(ITEMS), 2)]
    streamed = np.concatenate([response_matrix(r) for r in stub.EmbedStream(iter(requests), timeout=RPC_TIMEOUT_S)])
    np.testing.assert_allclose(streamed, expected, atol=ATOL)


def test_openai_content_parts_and_messages_equal_engine_embed(served, http):
    expected = _engine_embed(served, ITEMS)
    reply = http.post("/v1/embeddings", json={"model": CLIP, "input": [_part(x) for x in ITEMS]})
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose([d["embedding"] for d in reply.json()["data"]], expected, atol=ATOL)
    for item, row in ((PNG, expected[1]), ("a photo of a cat", expected[0])):
        content = [_part(item)] if isinstance(item, bytes) else [{"type": "text", "text": item}]
        reply = http.post("/v1/embeddings", json={"model": CLIP, "messages": [{"role": "user", "content": content}]})
        assert reply.status_code == 200, reply.text
        np.testing.assert_allclose(reply.json()["data"][0]["embedding"], row, atol=ATOL)
    sdk = openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)
    created = sdk.embeddings.create(model=CLIP, input=[_part(x) for x in ITEMS], encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in created.data], expected, atol=ATOL)


def test_client_and_cli_images_equal_engine_embed(served, tmp_path, capsys):
    expected = _engine_embed(served, ["a photo of a cat", "a page of text", PNG, JPEG])
    (tmp_path / "page.jpg").write_bytes(JPEG)
    with Client(served[0], model=CLIP) as client:
        got = client.embed(["a photo of a cat", "a page of text"], images=[PNG, tmp_path / "page.jpg"])
    np.testing.assert_allclose(got, expected, atol=ATOL)
    (tmp_path / "cat.png").write_bytes(PNG)
    code = cli.main(
        [
            "--target",
            served[0],
            "--model",
            CLIP,
            "embed",
            "a photo of a cat",
            "--image",
            str(tmp_path / "cat.png"),
            "--image",
            str(tmp_path / "page.jpg"),
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)["embeddings"]
    np.testing.assert_allclose(printed, expected[[0, 2, 3]], atol=ATOL)


def test_the_async_client_splits_images_within_the_limit(served):
    from embedserv_client import AsyncClient

    images = [png_bytes(random_image(10 + i, 24 + i, 30)) for i in range(MAX_IMAGES * 2 + 1)]
    expected = np.concatenate([_engine_embed(served, images[i : i + MAX_IMAGES]) for i in range(0, len(images), 4)])

    async def run():
        async with AsyncClient(served[0], model=CLIP) as client:
            return await client.embed(images=images)

    np.testing.assert_allclose(asyncio.run(run()), expected, atol=ATOL)


def _refused(stub, items: list) -> str:
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(_pb().EmbedRequest(model=CLIP, items=_grpc_items(items)), timeout=RPC_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    return error.value.details()


BAD_IMAGES = {
    "truncated PNG": truncated_png(),
    "1x1 PNG": png_bytes(random_image(4, 1, 1)),
    "20000x20000 PNG header": huge_png_header(20000, 20000),
    "random bytes": bytes(np.random.default_rng(5).integers(0, 256, 300, dtype=np.uint8)),
    "GIF": b"GIF89a" + bytes(40),
}


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_bad_images_are_refused_naming_the_input(stub, http, name):
    message = _refused(stub, ["a text", BAD_IMAGES[name]])
    assert "input 1" in message, message
    reply = http.post("/v1/embeddings", json={"model": CLIP, "input": ["a text", _part(BAD_IMAGES[name])]})
    assert reply.status_code == 400 and "input 1" in reply.json()["error"]["message"], reply.text


def test_limits_and_urls_are_refused(stub, http):
    message = _refused(stub, [PNG] * (MAX_IMAGES + 1))
    assert f"{MAX_IMAGES + 1} images; this server takes at most {MAX_IMAGES} images per call" in message
    message = _refused(stub, ["a text", PNG, PNG + bytes(MAX_BYTES)])
    assert f"input 2: the image has {len(PNG) + MAX_BYTES} bytes, over this server's limit of {MAX_BYTES}" in message
    # Images count as inputs toward --max-client-batch-size.
    message = _refused(stub, ["a", "b", "c", PNG, PNG, PNG, PNG])
    assert f"items holds 7 items, more than --max-client-batch-size {MAX_BATCH}" in message
    url = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    reply = http.post("/v1/embeddings", json={"model": CLIP, "input": ["a", url]})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("input 1: image URLs are never fetched")


def _fuzz_images(count: int) -> list[bytes]:
    """Random bytes, some behind a real format's magic bytes, and real images with bytes flipped or cut."""
    rng = np.random.default_rng(1234)
    magic = [b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff\xe0", b"RIFF\x00\x01\x00\x00WEBPVP8 "]
    real = [PNG, JPEG, WEBP]
    images = []
    for index in range(count):
        if index % 3 == 2:
            data = bytearray(real[index % len(real)])
            for at in rng.integers(0, len(data), int(rng.integers(1, 8))):
                data[at] = int(rng.integers(0, 256))
            images.append(bytes(data[: int(rng.integers(8, len(data) + 1))]))
        else:
            body = rng.integers(0, 256, int(rng.integers(0, 600)), dtype=np.uint8).tobytes()
            images.append(magic[index % len(magic)] + body)
    return images


def test_a_fuzz_of_random_bytes_never_takes_a_worker_down(served, stub):
    before = {(s.index, s.pid) for s in _worker_stats(served)}
    images = _fuzz_images(300)

    def send(start: int) -> grpc.StatusCode:
        request = _pb().EmbedRequest(model=CLIP, items=_grpc_items(["x", *images[start : start + 3]]))
        try:
            stub.Embed(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(send, range(0, len(images), 3)))
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, codes
    assert grpc.StatusCode.INVALID_ARGUMENT in codes
    stats = _worker_stats(served)
    assert {(s.index, s.pid) for s in stats} == before and all(s.ready and s.restarts == 0 for s in stats)
    reply = stub.Embed(_pb().EmbedRequest(model=CLIP, items=_grpc_items(ITEMS)), timeout=RPC_TIMEOUT_S)
    np.testing.assert_allclose(response_matrix(reply), _engine_embed(served, ITEMS), atol=ATOL)


def test_both_data_parallel_workers_answer_image_calls(served, stub):
    assert len(_worker_stats(served)) == WORKERS
    expected = _engine_embed(served, [PNG, JPEG])
    request = _pb().EmbedRequest(model=CLIP, items=_grpc_items([PNG, JPEG]))
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: stub.Embed(request, timeout=RPC_TIMEOUT_S), range(32)))
    for reply in replies:
        np.testing.assert_allclose(response_matrix(reply), expected, atol=ATOL)
    # Each worker's loop takes the next batch when it has room: under concurrent calls both run image batches.
    stats = _worker_stats(served)
    assert all(s.batches > 0 and s.restarts == 0 for s in stats), stats


def test_rerank_of_document_images_by_cosine_equals_engine_rerank(served, stub):
    from embedserv.types import RerankParams

    pages = [PNG, JPEG, WEBP]
    engine = _engine(served)
    ranked = engine.reranking.rerank("a photo of a cat", [ImageInput(p) for p in pages], RerankParams())
    expected = served[2].call(ranked, RPC_TIMEOUT_S)
    request = _pb().RerankRequest(model=CLIP, query="a photo of a cat", document_images=pages)
    reply = stub.Rerank(request, timeout=RPC_TIMEOUT_S)
    assert [r.index for r in reply.results] == [r.index for r in expected.results]
    np.testing.assert_allclose([r.score for r in reply.results], [r.score for r in expected.results], atol=ATOL)


def test_chunking_with_images_is_refused_over_http(http):
    reply = http.post("/v1/embeddings", json={"model": CLIP, "input": ["a", _part(PNG)], "chunking": "mean"})
    assert reply.status_code == 400
    assert "chunking and late_chunking apply to texts only" in reply.json()["error"]["message"]
