"""The HTTP faces' image inputs: data URLs decoded, every other URL refused with a message naming the input;
one input's content parts in their order (a text, an image, an image then its text: ImageInput.text; several
images, or text before an image: InterleavedInput), no parts refused saying what to send; vLLM's messages form
(one message's content, one embedding)."""

from __future__ import annotations

import base64

import pytest

from embedserv.errors import InvalidInput
from embedserv.server.http.image_inputs import (
    ImagePart,
    Message,
    TextPart,
    content_item,
    image_of_url,
    input_items,
    message_item,
)
from embedserv.types import ImageInput, InterleavedInput

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


def _text(text: str) -> TextPart:
    return TextPart(type="text", text=text)


def test_input_items_may_be_an_image_then_its_text():
    items = input_items(["first", [_part(URL), _text("what is shown")], [_text("alone")], [_part(URL)]])
    assert items == ["first", ImageInput(DATA, "what is shown"), "alone", ImageInput(DATA)]


@pytest.mark.parametrize(
    ("parts", "item"),
    [
        ([_part(URL), _part(URL)], InterleavedInput((DATA, DATA))),
        ([_part(URL), _text("a"), _part(URL)], InterleavedInput((DATA, "a", DATA))),
        ([_text("a"), _part(URL)], InterleavedInput(("a", DATA))),
        # Adjacent texts read as one, as the models' chat templates join them.
        ([_text("a"), _text("b")], "ab"),
        ([_part(URL), _text("a"), _text("b")], ImageInput(DATA, "ab")),
    ],
)
def test_parts_in_any_order_are_one_input(parts, item):
    assert content_item(parts, "input 3") == item


def test_no_content_is_refused_saying_what_to_send():
    with pytest.raises(
        InvalidInput, match="input 3 holds no content part; send a text part, an image_url part, or both"
    ):
        content_item([], "input 3")


def _message(*parts, role: str = "user") -> Message:
    return Message.model_validate({"role": role, "content": [part.model_dump() for part in parts]})


def test_the_messages_form_takes_one_messages_content():
    assert message_item([_message(_part(URL))]) == ImageInput(DATA)
    assert message_item([Message(role="user", content="a photo of a cat")]) == "a photo of a cat"
    assert message_item([_message(_part(URL), _text("what is shown"))]) == ImageInput(DATA, "what is shown")
    # A message with no parts holds nothing to embed, and is passed over.
    assert message_item([_message(role="system"), _message(_part(URL))]) == ImageInput(DATA)
    assert message_item([_message(_part(URL), _part(URL), _text("x"))]) == InterleavedInput((DATA, DATA, "x"))
    assert message_item([_message(_text("x"), _part(URL))]) == InterleavedInput(("x", DATA))
    spread = [Message(role="system", content="be brief"), _message(_part(URL), _text("x"))]
    with pytest.raises(InvalidInput, match=r"messages hold content in 2 messages; .*prompt_name picks"):
        message_item(spread)
