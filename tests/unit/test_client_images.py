"""The client's and CLI's images: bytes or file paths (an (image, text) pair: one item with its image_text; an
Interleaved input: one item with its parts, its images counted against the limit), sent in order after the texts,
cut into requests within the server's batch size and --max-images-per-request; page images for multi-vector and
rerank (with their text, and an image query, for Qwen3-VL rerankers); a file that cannot be read is named before any
call."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedserv_client import Client, Interleaved, cli
from embedserv_client.v1 import embedserv_pb2 as pb
from embedserv_client.v1 import embedserv_pb2_grpc as pb_grpc
from tests.helpers.client import serve_fake_inference
from tests.helpers.client_drivers import driver

BATCH, MAX_IMAGES = 4, 2


def _value(item: pb.InputItem) -> float:
    """A text's number, or minus the (first) image's first byte: what the fake embeds each input as."""
    if item.parts:
        return -float(next(part.image for part in item.parts if part.HasField("image"))[0])
    return float(item.text) if item.HasField("text") else -float(item.image[0])


class Recording(pb_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.requests: list = []

    def ListModels(self, request, context):
        model = pb.ModelInfo(
            name="clip",
            tasks=[pb.TASK_EMBED],
            dimension=2,
            modalities=["text", "image"],
            max_image_bytes=1024,
            max_image_pixels=4096,
        )
        limits = pb.ServerLimits(max_client_batch_size=BATCH, max_images_per_request=MAX_IMAGES)
        return pb.ListModelsResponse(models=[model], limits=limits)

    def Embed(self, request, context):
        self.requests.append(request)
        items = list(request.items) or [pb.InputItem(text=t) for t in request.inputs]
        rows = [np.array([_value(item), 1.0], dtype="<f4").tobytes() for item in items]
        return pb.EmbedResponse(embeddings=[pb.Embedding(raw=row) for row in rows])

    def EmbedMultiVector(self, request, context):
        self.requests.append(request)
        values = [float(t) for t in request.inputs] + [-float(data[0]) for data in request.images]
        vectors = [np.full((2, 3), v, dtype="<f4") for v in values]
        return pb.EmbedMultiVectorResponse(
            embeddings=[pb.MultiVector(num_vectors=2, dimension=3, raw=v.tobytes()) for v in vectors]
        )

    def Rerank(self, request, context):
        """Each document scores minus what the fake embeds it as: an image its first byte."""
        self.requests.append(request)
        items = list(request.document_items) or [pb.InputItem(image=data) for data in request.document_images]
        items = items or [pb.InputItem(text=text) for text in request.documents]
        return pb.RerankResponse(results=[pb.RerankResult(index=i, score=-_value(x)) for i, x in enumerate(items)])


@pytest.fixture
def recording():
    yield from serve_fake_inference(Recording())


def call(kind: str, target: str, method: str, *args, **kwargs):
    client = driver(kind, target)
    try:
        return getattr(client, method)(*args, **kwargs)
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_images_follow_the_texts_within_the_server_limits(recording, kind, tmp_path):
    servicer, target = recording
    (tmp_path / "page.png").write_bytes(bytes([7, 1, 2]))
    images = [bytes([1]), tmp_path / "page.png", str(tmp_path / "page.png"), bytearray([9]), bytes([5])]
    vectors = call(kind, target, "embed", ["10", "11"], images=images)
    np.testing.assert_array_equal(vectors[:, 0], [10, 11, -1, -7, -7, -9, -5])
    parts = [[item.WhichOneof("kind") for item in r.items] for r in servicer.requests]
    assert all(len(p) <= BATCH and p.count("image") <= MAX_IMAGES for p in parts), parts
    # The requests run in parallel: their order here is the server's; the result's order is checked above.
    assert sorted(kind for p in parts for kind in p) == ["image"] * 5 + ["text"] * 2
    assert not any(r.inputs for r in servicer.requests)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_image_with_its_text_is_one_item(recording, kind, tmp_path):
    servicer, target = recording
    (tmp_path / "page.png").write_bytes(bytes([7]))
    images = [(bytes([1]), "what is shown"), bytes([2]), (tmp_path / "page.png", "a page")]
    vectors = call(kind, target, "embed", ["10"], images=images)
    np.testing.assert_array_equal(vectors[:, 0], [10, -1, -2, -7])
    sent = {item.image[0]: item.image_text for r in servicer.requests for item in r.items if item.HasField("image")}
    assert sent == {1: "what is shown", 2: "", 7: "a page"}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_page_images_for_multi_vector_and_rerank(recording, kind):
    servicer, target = recording
    arrays = call(kind, target, "embed_multi_vector", ["3"], images=[bytes([4]), bytes([6]), bytes([8])])
    assert [float(a[0, 0]) for a in arrays] == [3, -4, -6, -8]
    assert all(len(r.images) <= MAX_IMAGES for r in servicer.requests)
    results = call(kind, target, "rerank", "a query", document_images=[bytes([2]), bytes([9]), bytes([5])])
    assert [(r.index, r.document) for r in results] == [(1, None), (2, None), (0, None)]
    assert not any(r.return_documents for r in servicer.requests if isinstance(r, pb.RerankRequest))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_interleaved_input_is_one_item_of_parts_in_order(recording, kind, tmp_path):
    servicer, target = recording
    (tmp_path / "page.png").write_bytes(bytes([7]))
    images = [Interleaved("a", bytes([3]), tmp_path / "page.png", "b"), bytes([4]), Interleaved(bytes([5]), "x")]
    vectors = call(kind, target, "embed", ["10"], images=images)
    np.testing.assert_array_equal(vectors[:, 0], [10, -3, -4, -5])
    sent = [[p.text or p.image for p in item.parts] for r in servicer.requests for item in r.items if item.parts]
    assert sorted(sent, key=len) == [[bytes([5]), "x"], ["a", bytes([3]), bytes([7]), "b"]]
    counts = [
        sum(int(i.HasField("image")) + sum(p.HasField("image") for p in i.parts) for i in r.items)
        for r in servicer.requests
    ]
    assert max(counts) <= MAX_IMAGES and sum(counts) == 4
    with Client(target) as client:
        with pytest.raises(TypeError, match=r"images\[0\].parts\[1\] must be bytes or a file path, not int"):
            client.embed(images=[Interleaved("a", 3)])


def test_unreadable_images_and_wrong_types_are_named(recording, tmp_path):
    _, target = recording
    with Client(target) as client:
        with pytest.raises(ValueError, match=r"images\[1\]: cannot read '.*missing.png': No such file"):
            client.embed(images=[b"x", tmp_path / "missing.png"])
        with pytest.raises(TypeError, match=r"images\[0\] must be bytes or a file path, not int"):
            client.embed(images=[3])
        with pytest.raises(TypeError, match="images must be a sequence of images"):
            client.embed(images=b"one image")
        with pytest.raises(TypeError, match=r"images\[1\] must be an image or an \(image, text\) pair"):
            client.embed(images=[b"x", (b"y", 3)])
        with pytest.raises(ValueError, match="give documents or document_images, not both"):
            client.rerank("q", ["d"], document_images=[b"x"])


def test_model_info_and_limits_carry_the_image_fields(recording):
    _, target = recording
    with Client(target) as client:
        (model,) = client.models()
        assert model.modalities == ("text", "image") and (model.max_image_bytes, model.max_image_pixels) == (1024, 4096)
        assert client.limits().max_images_per_request == MAX_IMAGES


def test_cli_embeds_image_files_after_the_texts(recording, tmp_path, capsys):
    _servicer, target = recording
    (tmp_path / "a.png").write_bytes(bytes([3]))
    (tmp_path / "b.jpg").write_bytes(bytes([4]))
    code = cli.main(
        ["--target", target, "embed", "12", "--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "b.jpg")]
    )
    assert code == 0
    assert [row[0] for row in json.loads(capsys.readouterr().out)["embeddings"]] == [12, -3, -4]


def test_cli_refuses_an_unreadable_image_before_calling(recording, tmp_path, capsys):
    servicer, target = recording
    code = cli.main(["--target", target, "embed", "--image", str(tmp_path / "nope.png")])
    assert code == 2
    assert f"--image {tmp_path / 'nope.png'}: cannot read it (No such file or directory)" in capsys.readouterr().err
    assert servicer.requests == []
    code = cli.main(["--target", target, "embed", "--image", str(tmp_path)])
    assert code == 2 and "cannot read it (Is a directory)" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_rerank_images_with_their_text_and_an_image_query(recording, kind):
    servicer, target = recording
    results = call(kind, target, "rerank", "q", document_images=[(bytes([2]), "a chart"), bytes([9]), bytes([5])])
    assert [r.index for r in results] == [1, 2, 0]
    sent = [r for r in servicer.requests if isinstance(r, pb.RerankRequest)]
    assert all(r.document_items and not r.document_images for r in sent)
    assert {item.image[0]: item.image_text for r in sent for item in r.document_items} == {2: "a chart", 9: "", 5: ""}
    servicer.requests.clear()
    # The query's image counts against the server's images per request: one document image beside it.
    results = call(kind, target, "rerank", "which", document_images=[bytes([3]), bytes([4])], query_image=bytes([7]))
    assert [r.index for r in results] == [1, 0] and len(servicer.requests) == 2
    assert all(len(r.document_images) == 1 for r in servicer.requests)
    queries = {(r.query, r.query_item.image, r.query_item.image_text) for r in servicer.requests}
    assert queries == {("", bytes([7]), "which")}
    servicer.requests.clear()
    results = call(kind, target, "rerank", "which", ["2", "1"], query_image=bytes([7]))
    assert [r.index for r in results] == [1, 0]
    assert [list(r.documents) for r in servicer.requests] == [["2", "1"]]
