"""Images in client calls: each given as bytes or a file path, read once here; and the plans that carry them.

A call's images are cut into requests of at most the server's --max-images-per-request (ListModels'
limits) as well as its batch size, so a long list of pages needs no splitting by the caller."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedserv_client import plans
from embedserv_client.types import multi_vector
from embedserv_client.v1 import embedserv_pb2 as pb

# An image: its encoded bytes (PNG, JPEG, WebP), or the path of a file holding them.
ImageLike = bytes | bytearray | memoryview | str | os.PathLike


@dataclass(frozen=True, init=False)
class Interleaved:
    """One input of texts and images in the order the model reads them, one vector for all of it
    (InputItem.parts): `Interleaved("compare", chart, "with", photo)`. A str part is a text; bytes (or a bytearray
    or memoryview) or an os.PathLike (pathlib.Path) part is an image: a path given as a str would read as text,
    so wrap it in Path. For the vision-language embedders (GME, DSE, Qwen3-VL-Embedding); other models refuse
    several images in one input, or text before an image."""

    parts: tuple[str | bytes | bytearray | memoryview | os.PathLike, ...]

    def __init__(self, *parts: str | bytes | bytearray | memoryview | os.PathLike) -> None:
        object.__setattr__(self, "parts", parts)


# An image to embed, (image, text): the image with text after it, one vector for both (InputItem.image_text), or
# an Interleaved input; the last two for vision-language embedders such as GME / DSE on Qwen2-VL, others refuse them.
EmbedImage = ImageLike | tuple[ImageLike, str] | Interleaved
# A rerank document image: alone, or with text after it (Qwen3-VL rerankers).
DocumentImage = ImageLike | tuple[ImageLike, str]


def image_bytes(images: Iterable[ImageLike], what: str = "images") -> list[bytes]:
    """Each image's encoded bytes; a path is read now, and one that cannot be read is named in the error."""
    if isinstance(images, (str, bytes, os.PathLike)):
        raise TypeError(f"{what} must be a sequence of images (bytes or file paths), not one {type(images).__name__}")
    return [_read(image, f"{what}[{index}]") for index, image in enumerate(images)]


def _read(image: ImageLike, what: str) -> bytes:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        try:
            return Path(image).read_bytes()
        except OSError as exc:
            raise ValueError(f"{what}: cannot read {os.fspath(image)!r}: {exc.strerror or exc}") from exc
    raise TypeError(f"{what} must be bytes or a file path, not {type(image).__name__}")


def embed_items(images: Iterable[EmbedImage]) -> list[pb.InputItem]:
    """embed's images as EmbedRequest.items: an image with its text after it ("" for an image alone), or an
    Interleaved input's parts in order."""
    if isinstance(images, (str, bytes, os.PathLike)):
        raise TypeError(f"images must be a sequence of images (bytes or file paths), not one {type(images).__name__}")
    items = []
    for index, image in enumerate(images):
        if isinstance(image, Interleaved):
            items.append(pb.InputItem(parts=_parts(image, f"images[{index}]")))
            continue
        pair = image if isinstance(image, tuple) else (image, "")
        if len(pair) != 2 or not isinstance(pair[1], str):
            raise TypeError(
                f"images[{index}] must be an image or an (image, text) pair with a str text, or an Interleaved input"
            )
        items.append(pb.InputItem(image=_read(pair[0], f"images[{index}]"), image_text=pair[1]))
    return items


def _parts(item: Interleaved, what: str) -> list[pb.InputPart]:
    if not item.parts:
        raise ValueError(f"{what} is an Interleaved input without parts; give it texts and images")
    return [
        pb.InputPart(text=part) if isinstance(part, str) else pb.InputPart(image=_read(part, f"{what}.parts[{i}]"))
        for i, part in enumerate(item.parts)
    ]


def image_items(images: Iterable[DocumentImage], what: str = "images") -> list[tuple[bytes, str]]:
    """embed's images as (bytes, text after the image); "" for an image alone."""
    if isinstance(images, (str, bytes, os.PathLike)):
        raise TypeError(f"{what} must be a sequence of images (bytes or file paths), not one {type(images).__name__}")
    pairs = [image if isinstance(image, tuple) else (image, "") for image in images]
    for index, pair in enumerate(pairs):
        if len(pair) != 2 or not isinstance(pair[1], str):
            raise TypeError(f"{what}[{index}] must be an image or an (image, text) pair with a str text")
    return [(_read(image, f"{what}[{index}]"), text) for index, (image, text) in enumerate(pairs)]


def image_batch_size(size: int, max_images: int) -> int:
    """Images one request may carry: the batch size, within the server's images-per-request limit (0 from a
    server that takes no images: the batch size, and the server says why it refuses them)."""
    return min(size, max_images) if max_images > 0 else size


def embed_items_plan(
    texts: list[str], images: Iterable[EmbedImage], size: int, image_size: int, **fields
) -> plans.Plan:
    """Texts then images (each with its text after it, if any; Interleaved inputs with their parts) as
    EmbedRequest.items, cut into requests within `size` items and `image_size` images (an input whose images
    alone pass it goes alone, and the server says why it refuses it); the result's rows in that order."""
    items = [pb.InputItem(text=text) for text in texts] + embed_items(images)
    parts: list[list[pb.InputItem]] = [[]]
    images_in_part = 0
    for item in items:
        count = int(item.HasField("image")) + sum(part.HasField("image") for part in item.parts)
        if parts[-1] and (len(parts[-1]) == size or images_in_part + count > image_size):
            parts.append([])
            images_in_part = 0
        parts[-1].append(item)
        images_in_part += count
    requests = [pb.EmbedRequest(items=part, **fields) for part in parts]
    return plans.Plan("Embed", requests, plans.embed_merge(fields, single=False), max(len(p) for p in parts))


def multi_vector_plan(
    texts: list[str], images: Iterable[ImageLike], size: int, image_size: int, **fields
) -> plans.Plan:
    """The texts' vectors, then the images' (page images of ColPali-style models; bytes or file paths, read now)."""
    pages = image_bytes(images)
    text_parts = plans.chunks(texts, size) if texts else []
    requests = [pb.EmbedMultiVectorRequest(inputs=part, **fields) for part in text_parts]
    requests += [pb.EmbedMultiVectorRequest(images=part, **fields) for part in plans.chunks(pages, image_size)]

    def merge(replies: list[pb.EmbedMultiVectorResponse]) -> list[np.ndarray]:
        return [multi_vector(m) for reply in replies for m in reply.embeddings]

    return plans.Plan("EmbedMultiVector", requests, merge, max(min(size, len(texts)), min(image_size, len(pages))))


def rerank_images_plan(
    query: str,
    texts: list[str],
    images: Iterable[DocumentImage] | None,
    query_image: ImageLike | None,
    size: int,
    image_size: int,
    top_n: int | None,
    **fields,
) -> plans.Plan:
    """Rerank with images: the documents' images (document_images; document_items where one has text after it, for
    models that read both), and/or the query's image with `query` as its text (query_item, for Qwen3-VL rerankers),
    in requests of at most `size` documents and `image_size` images, the query's among them. Images are never
    echoed."""
    asked: str | pb.InputItem = query
    if query_image is not None:
        asked = pb.InputItem(image=image_bytes([query_image], "query_image")[0], image_text=query)
    if images is None:
        return plans.rerank_plan(asked, texts, size, top_n, **fields)
    if texts:
        raise ValueError("give documents or document_images, not both")
    pairs = image_items(images, "document_images")
    fields["return_documents"] = False
    part = max(min(size, image_size - (query_image is not None)), 1)
    if any(text for _, text in pairs):
        items = [pb.InputItem(image=data, image_text=text) for data, text in pairs]
        return plans.rerank_plan(asked, items, part, top_n, field="document_items", **fields)
    return plans.rerank_plan(asked, [data for data, _ in pairs], part, top_n, field="document_images", **fields)
