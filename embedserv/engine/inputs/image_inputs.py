"""Embed's image inputs: the refusals a call with images (or a call to a model that takes them) gets before
anything is decoded, and its inputs as sequences: texts tokenized as usual, images decoded and preprocessed
(engine/inputs/images) in the tokenizer pool, never on the event loop, each input with images becoming the model's
sequence through its TokenRules (encode_image; encode_interleaved for texts and images interleaved). Results keep
the call's input order."""

from __future__ import annotations

from collections.abc import Sequence

from embedserv.engine.inputs.images import prepare_image
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules
from embedserv.engine.inputs.vl_embed_rules import MAX_IMAGES_PER_INPUT, too_many_images
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel, VisionSpec
from embedserv.errors import InvalidInput
from embedserv.types import EmbedInput, EmbedOutput, EmbedParams, ImageInput, InterleavedInput, Modality


def simplest_input(parts: Sequence[str | bytes]) -> EmbedInput:
    """The parts of one input as the simplest type that holds them: texts alone joined into one str (as the
    models' chat templates join adjacent text parts), an image alone or followed by texts an ImageInput, anything
    else (several images, text before an image) an InterleavedInput."""
    images = [index for index, part in enumerate(parts) if isinstance(part, bytes)]
    text = "".join(part for part in parts if isinstance(part, str))
    if not images:
        return text
    first = parts[0]
    if images == [0] and isinstance(first, bytes):
        return ImageInput(first, text)
    return InterleavedInput(tuple(parts))


def input_images(item: EmbedInput) -> tuple[bytes, ...]:
    """An input's images, in order (none for a text)."""
    if isinstance(item, ImageInput):
        return (item.data,)
    return tuple(p for p in item.parts if isinstance(p, bytes)) if isinstance(item, InterleavedInput) else ()


def input_texts(item: EmbedInput) -> tuple[str, ...]:
    """An input's texts, in order (an image's text after it; none for an image alone)."""
    if isinstance(item, ImageInput):
        return (item.text,) if item.text else ()
    return tuple(p for p in item.parts if isinstance(p, str)) if isinstance(item, InterleavedInput) else (item,)


def image_indices(inputs: list) -> list[int]:
    """The inputs that hold images or are interleaved (an InterleavedInput of texts alone too)."""
    return [index for index, item in enumerate(inputs) if isinstance(item, (ImageInput, InterleavedInput))]


def check_call(served: ServedModel, inputs: list, params: EmbedParams) -> None:
    """What a call with images, or any call to a dual encoder, cannot ask for."""
    info, found = served.info, image_indices(inputs)
    interleaved = [index for index in found if isinstance(inputs[index], InterleavedInput)]
    if interleaved and not served.token_rules.takes_interleaved:
        alone = "one text or one image" if Modality.IMAGE in info.modalities else "one text"
        raise InvalidInput(
            f"model {info.name!r} takes {alone} per input; input {interleaved[0]} holds texts and images "
            f"interleaved: send each of its parts as an input of its own (its own vector)"
        )
    if found and Modality.IMAGE not in info.modalities:
        raise InvalidInput(f"model {info.name!r} takes text only; input {found[0]} is an image")
    if served.spec.family.vision is not None and (params.chunking or params.late_chunking is not None):
        # Each input is pooled by its tower's own head: there is no token-count-weighted mean to take.
        raise InvalidInput(
            f"model {info.name!r} is a text-image dual encoder; chunking and late_chunking are not served for it. "
            "Leave them unset (set truncate to cut long texts)"
        )
    if not found:
        return
    with_text = [index for index in found if isinstance(inputs[index], ImageInput) and inputs[index].text]
    if with_text and not served.token_rules.takes_interleaved:
        raise InvalidInput(
            f"model {info.name!r} takes an image alone; input {with_text[0]} has text with its image: send the text "
            "as an input of its own (its own vector)"
        )
    for index in interleaved:
        if len(input_images(inputs[index])) > MAX_IMAGES_PER_INPUT:
            raise too_many_images(f"input {index}", len(input_images(inputs[index])))
    if params.chunking or params.late_chunking is not None:
        raise InvalidInput(f"chunking and late_chunking apply to texts; input {found[0]} is an image")
    if EmbedOutput.SPARSE in params.outputs:
        raise InvalidInput(f"the sparse output is made from texts; input {found[0]} is an image")
    if params.prompt_name and all(not input_texts(item) for item in inputs):
        raise InvalidInput("prompt_name applies to texts, and this call sends only images; leave it unset")


async def encode_inputs(
    core: Core, served: ServedModel, rules: TokenRules, inputs: list, params: EmbedParams
) -> list[InputSequence]:
    """Every input as a sequence, in input order; prompts apply to the texts only."""
    found = image_indices(inputs)
    text_at = [index for index, item in enumerate(inputs) if isinstance(item, str)]
    encoded: list[InputSequence | None] = [None] * len(inputs)
    if text_at:
        texts = [inputs[index] for index in text_at]
        encode_texts = rules.text_encoder(served.tokenizer)
        tokenized = await core.tokenize_with(encode_texts, texts, params, chars=sum(map(len, texts)))
        for index, item in zip(text_at, tokenized, strict=True):
            encoded[index] = item
    images = [(index, inputs[index]) for index in found]
    # No `chars`: decoding is never cheap enough for the event loop.
    prepared = await core.tokenize_with(_encode_images, rules, served.vision, images, params)
    for index, item in zip(found, prepared, strict=True):
        encoded[index] = item
    return encoded


def _encode_images(
    rules: TokenRules, vision: VisionSpec, items: list[tuple[int, ImageInput | InterleavedInput]], params: EmbedParams
) -> list[InputSequence]:
    """Blocking: decode, preprocess and shape each image (an ImageError names the first bad input, and which of
    its images), with its text where it has one."""
    out = []
    for index, item in items:
        if isinstance(item, ImageInput):
            rows, grid = prepare_image(item.data, index, vision.processing, vision.limits)
            text = (item.text,) if item.text else ()
            out.append(rules.encode_image(rows, grid, params, *text))
        else:
            parts: list = []
            images = 0
            for part in item.parts:
                if isinstance(part, bytes):
                    part = prepare_image(part, f"{index} (image {images})", vision.processing, vision.limits)
                    images += 1
                parts.append(part)
            out.append(rules.encode_interleaved(parts, params, f"input {index}"))
    return out
