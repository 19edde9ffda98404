"""Images on the HTTP faces: content parts in the shape vLLM's multimodal embeddings take, and data URLs.

`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` and `{"type": "text", "text": ...}`
come either as `messages` (vLLM's form: one embedding for the message's content) or, as our extension, as
items of `input` (one embedding per item: a part, or a list of parts); Cohere v2's `inputs` carry the same parts.
One input's parts are read in their order, one vector for all of them: a text, an image, an image then its text
(ImageInput), or texts and images interleaved, several images included (InterleavedInput, for models that take
them; engine/inputs/image_inputs.simplest_input picks the type). Only data URLs are read: an http(s) URL is
refused, never fetched, so a call cannot make the server reach another host.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from pydantic import Field

from embedserv.engine.inputs.image_inputs import simplest_input
from embedserv.errors import InvalidInput
from embedserv.server.http.common import Body
from embedserv.types import EmbedInput, ImageInput

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


def input_items(inputs: list) -> list[EmbedInput]:
    """`input`'s items (texts, content parts, lists of content parts) as texts and images, in order."""
    return [
        content_item(value if isinstance(value, list) else [value], f"input {index}")
        for index, value in enumerate(inputs)
    ]


def content_item(parts: list, what: str) -> EmbedInput:
    """One input's content parts (plain strings count as text parts) in their order, as the simplest input type
    that holds them (engine/inputs/image_inputs.simplest_input): whether the model takes several images, or text
    before an image, is the engine's to say."""
    if not parts:
        raise InvalidInput(f"{what} holds no content part; send a text part, an image_url part, or both")
    return simplest_input([_part(part, what) for part in parts])


def _part(value: str | ImagePart | TextPart, what: str) -> str | bytes:
    if isinstance(value, str):
        return value
    if isinstance(value, TextPart):
        return value.text
    return image_of_url(value.image_url.url, what).data


def message_item(messages: list[Message]) -> EmbedInput:
    """vLLM's messages form: one message's content (texts and images in any order) as one input. Content spread
    over several messages is refused: the model's own framing supplies the system turn (prompt_name picks its
    instruction)."""
    holding = [m for m in messages if isinstance(m.content, str) or m.content]
    if len(holding) != 1:
        raise InvalidInput(
            f"messages hold content in {len(holding)} messages; this form embeds one message's content (texts and "
            "images; prompt_name picks a model's instruction). For one embedding each, send them as items of input "
            "instead"
        )
    content = holding[0].content
    return content_item([content] if isinstance(content, str) else content, "input 0")
