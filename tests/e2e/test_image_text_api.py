"""An image with its text, and texts and several images interleaved, as one input over every face of one in-process
server serving a tiny random-weight Qwen2-VL embedder (tests/helpers/qwen_vl_models.py) beside a tiny CLIP: gRPC
items (image + image_text; parts), OpenAI's messages form (content parts in any order) and `input` items that are
lists of content parts, Cohere v2 `inputs` (the cohere SDK's ClientV2) and the Python client's (image, text) pairs
and Interleaved inputs all give Engine.embed's vectors for ImageInput(data, text) and InterleavedInput(parts), which
tests/models/test_qwen_vl_embed_engine.py pins to transformers. The refusals say what to change: image_text beside a
text, parts beside a text, text with an image or interleaved parts on CLIP (which embeds an image alone), an image's
text past --max-input-chars, an interleaved input's images past the call's image limit."""

from __future__ import annotations

import base64

import cohere
import grpc
import numpy as np
import pytest

from embedserv.types import EmbedParams, ImageInput, InterleavedInput
from embedserv_client import Client, Interleaved
from tests.helpers.client import RPC_TIMEOUT_S, response_matrix
from tests.helpers.compat_http import pb as _pb
from tests.helpers.inprocess import in_process_http_server
from tests.helpers.qwen_vl_models import build_tiny_qwen_vl
from tests.helpers.served_fixtures import http, target  # noqa: F401 (fixtures)
from tests.helpers.vision_language_models import page_image
from tests.helpers.vision_models import save_dual_encoder

QWEN, CLIP = "tiny-qwen2-vl", "tiny-clip"
MAX_CHARS = 500
ATOL = 1e-5
WIDE = page_image(56, 84, seed=1)
TALL = page_image(112, 56, seed=2, fmt="JPEG")
# Texts and images, some with text after them, as the engine takes them.
INPUTS = [
    "what is a socket",
    ImageInput(WIDE, "what does the chart show"),
    ImageInput(TALL),
    ImageInput(TALL, "a receipt"),
]
# Texts and images interleaved: two images with text between; text first, then three images.
INTERLEAVED = [
    InterleavedInput(("compare", WIDE, "with", TALL)),
    InterleavedInput(("a report:", TALL, WIDE, "and", TALL)),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    qwen_dir = build_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")
    clip_dir = save_dual_encoder(tmp_path_factory.mktemp("clip") / "clip", "clip")
    args = [
        "--model", str(qwen_dir), "--served-model-name", QWEN,
        "--model", str(clip_dir), "--served-model-name", CLIP,
        "--dtype", "float32", "--device", "cpu", "--max-input-chars", str(MAX_CHARS),
    ]  # fmt: skip
    with in_process_http_server(args) as served:
        yield served


@pytest.fixture(scope="module")
def expected(served) -> np.ndarray:
    """Engine.embed of INPUTS on the server's own loop: one row per input."""
    engine = served[2].server.frontend.models.get(QWEN)
    rows = served[2].call(engine.embedding.embed(INPUTS, EmbedParams()), RPC_TIMEOUT_S).embeddings
    assert rows.shape == (4, 64)
    return rows


@pytest.fixture(scope="module")
def expected_interleaved(served) -> np.ndarray:
    engine = served[2].server.frontend.models.get(QWEN)
    return served[2].call(engine.embedding.embed(INTERLEAVED, EmbedParams()), RPC_TIMEOUT_S).embeddings


def _grpc_item(item):
    pb = _pb()
    if isinstance(item, str):
        return pb.InputItem(text=item)
    if isinstance(item, InterleavedInput):
        parts = [pb.InputPart(text=p) if isinstance(p, str) else pb.InputPart(image=p) for p in item.parts]
        return pb.InputItem(parts=parts)
    return pb.InputItem(image=item.data, image_text=item.text)


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _parts(item) -> list[dict]:
    """One input as OpenAI / Cohere content parts, in its order (an ImageInput: the image, then its text)."""
    if isinstance(item, str):
        return [{"type": "text", "text": item}]
    parts = item.parts if isinstance(item, InterleavedInput) else (item.data, item.text)
    return [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": _url(p)}}
        for p in parts
        if p
    ]


def _http_error(reply, key=("error", "message")) -> str:
    assert reply.status_code == 400, reply.text
    body = reply.json()
    return body[key[0]][key[1]] if key[0] == "error" else body[key[0]]


def test_the_text_after_an_image_changes_its_vector(expected):
    assert not np.allclose(expected[2], expected[3], atol=1e-3)


def test_grpc_items_with_image_text(stub, expected):
    pb = _pb()
    request = pb.EmbedRequest(model=QWEN, items=[_grpc_item(item) for item in INPUTS], encoding=pb.ENCODING_BYTES)
    got = response_matrix(stub.Embed(request, timeout=RPC_TIMEOUT_S))
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("index", [1, 2, 3])
def test_openai_messages_with_an_image_and_its_text(http, expected, index):
    body = {"model": QWEN, "messages": [{"role": "user", "content": _parts(INPUTS[index])}]}
    reply = http.post("/v1/embeddings", json=body)
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json()["data"][0]["embedding"], expected[index], rtol=0, atol=ATOL)


def test_openai_input_items_as_lists_of_parts(http, expected):
    items = [INPUTS[0], _parts(INPUTS[1]), _parts(INPUTS[2])[0], _parts(INPUTS[3])]
    reply = http.post("/v1/embeddings", json={"model": QWEN, "input": items})
    assert reply.status_code == 200, reply.text
    got = np.array([row["embedding"] for row in reply.json()["data"]])
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


def test_cohere_v2_inputs_through_the_sdk(served, expected):
    client = cohere.ClientV2(base_url=served[1], api_key="unused", timeout=RPC_TIMEOUT_S)
    inputs = [cohere.EmbedInput(content=_parts(item)) for item in INPUTS]
    reply = client.embed(model=QWEN, input_type="search_document", inputs=inputs, embedding_types=["float"])
    np.testing.assert_allclose(np.array(reply.embeddings.float_), expected, rtol=0, atol=ATOL)


def test_the_client_sends_image_and_text_pairs(served, expected):
    with Client(served[0], model=QWEN) as client:
        got = client.embed([INPUTS[0]], images=[(WIDE, INPUTS[1].text), TALL, (TALL, INPUTS[3].text)])
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


def test_interleaved_inputs_over_grpc_openai_cohere_and_the_client(served, stub, http, expected_interleaved):
    pb = _pb()
    request = pb.EmbedRequest(model=QWEN, items=[_grpc_item(item) for item in INTERLEAVED], encoding=pb.ENCODING_BYTES)
    np.testing.assert_allclose(
        response_matrix(stub.Embed(request, timeout=RPC_TIMEOUT_S)), expected_interleaved, atol=ATOL
    )
    for index, item in enumerate(INTERLEAVED):
        body = {"model": QWEN, "messages": [{"role": "user", "content": _parts(item)}]}
        reply = http.post("/v1/embeddings", json=body)
        assert reply.status_code == 200, reply.text
        np.testing.assert_allclose(reply.json()["data"][0]["embedding"], expected_interleaved[index], rtol=0, atol=ATOL)
    reply = http.post("/v2/embed", json={"model": QWEN, "inputs": [{"content": _parts(i)} for i in INTERLEAVED]})
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json()["embeddings"]["float"], expected_interleaved, rtol=0, atol=ATOL)
    with Client(served[0], model=QWEN) as client:
        got = client.embed(images=[Interleaved(*item.parts) for item in INTERLEAVED])
    np.testing.assert_allclose(got, expected_interleaved, rtol=0, atol=ATOL)


def _grpc_refusal(stub, model: str, items: list) -> str:
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(_pb().EmbedRequest(model=model, items=items), timeout=RPC_TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return error.value.details()


def test_grpc_refusals_say_what_to_change(stub):
    pb = _pb()
    beside_text = _grpc_refusal(stub, QWEN, [pb.InputItem(image=WIDE), pb.InputItem(text="x", image_text="y")])
    assert "items[1] sets image_text beside a text" in beside_text and "set image with it" in beside_text
    on_clip = _grpc_refusal(stub, CLIP, [pb.InputItem(text="x"), pb.InputItem(image=WIDE, image_text="y")])
    assert f"model '{CLIP}' takes an image alone; input 1 has text with its image: send the text as an input" in (
        on_clip
    )
    too_long = _grpc_refusal(stub, QWEN, [pb.InputItem(image=WIDE, image_text="x" * (MAX_CHARS + 1))])
    assert f"items[0] has {MAX_CHARS + 1} characters, more than the server's --max-input-chars" in too_long
    parts = _grpc_item(INTERLEAVED[0]).parts
    beside = _grpc_refusal(stub, QWEN, [pb.InputItem(text="x", parts=parts)])
    assert "items[0] sets parts beside text; parts hold the whole input" in beside
    empty = _grpc_refusal(stub, QWEN, [pb.InputItem(parts=[pb.InputPart(text="x"), pb.InputPart()])])
    assert "items[0].parts[1] holds neither a text nor an image" in empty
    interleaved_on_clip = _grpc_refusal(stub, CLIP, [pb.InputItem(text="x"), _grpc_item(INTERLEAVED[0])])
    assert (
        f"model '{CLIP}' takes one text or one image per input; input 1 holds texts and images interleaved: send"
        in (interleaved_on_clip)
    )
    many = _grpc_refusal(stub, QWEN, [pb.InputItem(parts=[pb.InputPart(image=WIDE)] * 17)])
    assert "the call carries 17 images; this server takes at most 16 images per call" in many


def test_http_refusals_say_what_to_change(http):
    image, text = _parts(INPUTS[1])
    two_images = http.post("/v1/embeddings", json={"model": CLIP, "messages": [{"content": [image, image, text]}]})
    assert f"model '{CLIP}' takes one text or one image per input; input 0 holds texts and images" in _http_error(
        two_images
    )
    on_clip = http.post("/v2/embed", json={"model": CLIP, "inputs": [{"content": [image, text]}]})
    assert f"model '{CLIP}' takes an image alone; input 0 has text" in _http_error(on_clip, ("message", ""))
    both = http.post("/v2/embed", json={"model": QWEN, "texts": ["x"], "inputs": [{"content": [text]}]})
    assert "send texts, images or inputs, one of the three (the call sends texts and inputs)" in _http_error(
        both, ("message", "")
    )
