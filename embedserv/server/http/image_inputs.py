"""Images on the OpenAI face: content parts in the shape vLLM's multimodal embeddings take, and data URLs.

`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` and `{"type": "text", "text": ...}`
come either as `messages` (vLLM's form: one embedding for the message's content) or, as our extension, as
items of `input` (one embedding per item). Only data URLs are read: an http(s) URL is refused, never fetched,
so a call cannot make the server reach another host.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from pydantic import Field

from embedserv.errors import InvalidInput
from embedserv.server.http.common import Body
from embedserv.types import ImageInput

# The media types a data URL may name (image/jpg is a common misspelling of image/jpeg).
IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp"})
_EXAMPLE = "data:image/png;base64,..."


class ImageUrl(Body):
    url: str = Field(description=f"A data URL ({_EXAMPLE}); http(s) URLs are refused, never fetched.")
    detail: str | None = None


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class TextPart(Body):
    type: Literal["text"]
    text: str


ContentPart = Annotated[ImagePart | TextPart, Field(discriminator="type")]


class Message(Body):
    role: str = "user"
    content: str | list[ContentPart]


def image_of_url(url: str, what: str) -> ImageInput:
    """The image a data URL carries; `what` names the input in the messages."""
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https://")):
        raise InvalidInput(f"{what}: image URLs are never fetched; send the image inline as a data URL ({_EXAMPLE})")
    if not scheme.startswith("data:"):
        raise InvalidInput(f"{what}: image_url.url must be a data URL ({_EXAMPLE}); no other scheme is read")
    header, comma, payload = url[5:].partition(",")
    media_type, *options = header.split(";")
    if not comma or media_type.strip().lower() not in IMAGE_TYPES:
        raise InvalidInput(
            f"{what}: the data URL must name image/png, image/jpeg or image/webp, as in {_EXAMPLE} "
            f"(it names {media_type[:40]!r})"
        )
    if "base64" not in (option.strip().lower() for option in options):
        raise InvalidInput(f"{what}: the data URL's image must be base64-encoded ({_EXAMPLE})")
    try:
        return ImageInput(base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise InvalidInput(f"{what}: the data URL's payload is not valid base64 ({exc})") from None


def input_items(inputs: list) -> list[str | ImageInput]:
    """`input`'s items (texts and content parts) as texts and images, in order."""
    return [_item(value, f"input {index}") for index, value in enumerate(inputs)]


def _item(value: str | ImagePart | TextPart, what: str) -> str | ImageInput:
    if isinstance(value, str):
        return value
    if isinstance(value, TextPart):
        return value.text
    return image_of_url(value.image_url.url, what)


def message_item(messages: list[Message]) -> str | ImageInput:
    """vLLM's messages form: the one text or image its content holds, for a model embedding either one
    (CLIP / SigLIP); more parts than one are refused rather than silently joined."""
    parts = [part for m in messages for part in ([m.content] if isinstance(m.content, str) else m.content)]
    if len(parts) != 1:
        raise InvalidInput(
            f"messages hold {len(parts)} content parts; this form embeds one text or one image. For one "
            "embedding each, send them as items of input instead (content parts or texts)"
        )
    return _item(parts[0], "input 0")
