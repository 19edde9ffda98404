"""The OpenAI face's image inputs: data URLs decoded, every other URL refused with a message naming the input,
and vLLM's messages form (one content part, one embedding)."""

from __future__ import annotations

import base64

import pytest

from embedserv.errors import InvalidInput
from embedserv.server.http.image_inputs import ImagePart, Message, TextPart, image_of_url, input_items, message_item
from embedserv.types import ImageInput

DATA = b"\x89PNG\r\n\x1a\n some bytes"
URL = "data:image/png;base64," + base64.b64encode(DATA).decode()


def _part(url: str) -> ImagePart:
    return ImagePart.model_validate({"type": "image_url", "image_url": {"url": url}})


@pytest.mark.parametrize("media_type", ["image/png", "image/jpeg", "image/webp", "IMAGE/JPG"])
def test_a_base64_data_url_gives_its_bytes(media_type):
    url = f"data:{media_type};base64," + base64.b64encode(DATA).decode()
    assert image_of_url(url, "input 0") == ImageInput(DATA)


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "HTTPS://example.com/cat.png"])
def test_http_urls_are_refused_never_fetched(url):
    with pytest.raises(InvalidInput, match=r"^input 2: image URLs are never fetched; send the image inline"):
        image_of_url(url, "input 2")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("file:///etc/passwd", "must be a data URL"),
        ("ftp://host/x.png", "must be a data URL"),
        ("data:text/plain;base64,aGVsbG8=", "must name image/png, image/jpeg or image/webp"),
        ("data:image/gif;base64,aGVsbG8=", "'image/gif'"),
        ("data:image/png;base64", "must name image/png"),
        ("data:image/png,rawbytes", "must be base64-encoded"),
        ("data:image/png;base64,not*base64!", "not valid base64"),
        ("data:image/png;base64,aGVsbG8", "not valid base64"),
    ],
)
def test_other_urls_and_bad_payloads_are_refused_naming_the_input(url, says):
    with pytest.raises(InvalidInput) as error:
        image_of_url(url, "input 1")
    assert str(error.value).startswith("input 1: ") and says in str(error.value)


def test_input_items_keep_order_and_name_the_bad_one():
    text = TextPart(type="text", text="a cat")
    assert input_items(["first", _part(URL), text]) == ["first", ImageInput(DATA), "a cat"]
    with pytest.raises(InvalidInput, match=r"^input 1: image URLs are never fetched"):
        input_items(["first", _part("http://host/x.png")])


def test_the_messages_form_takes_one_part():
    image = Message.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}}]})
    assert message_item([image]) == ImageInput(DATA)
    assert message_item([Message(role="user", content="a photo of a cat")]) == "a photo of a cat"
    two = Message.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": URL}}]}
    )
    with pytest.raises(InvalidInput, match="messages hold 2 content parts; this form embeds one text or one image"):
        message_item([two])
