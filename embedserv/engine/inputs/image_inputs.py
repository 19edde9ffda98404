"""Embed's image inputs: the refusals a call with images (or a call to a model that takes them) gets before
anything is decoded, and its inputs as sequences: texts tokenized as usual, images decoded and preprocessed
(engine/inputs/images) in the tokenizer pool, never on the event loop, each becoming the model's sequence through
its TokenRules.encode_image. Results keep the call's input order."""

from __future__ import annotations

from embedserv.engine.inputs.images import prepare_image
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel, VisionSpec
from embedserv.errors import InvalidInput
from embedserv.types import EmbedOutput, EmbedParams, ImageInput, Modality


def image_indices(inputs: list) -> list[int]:
    return [index for index, item in enumerate(inputs) if isinstance(item, ImageInput)]


def check_call(served: ServedModel, inputs: list, params: EmbedParams) -> None:
    """What a call with images, or any call to a dual encoder, cannot ask for."""
    info, found = served.info, image_indices(inputs)
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
    with_text = [index for index in found if inputs[index].text]
    if with_text and not served.token_rules.takes_image_text:
        raise InvalidInput(
            f"model {info.name!r} takes an image alone; input {with_text[0]} has text with its image: send the text "
            "as an input of its own (its own vector)"
        )
    if params.chunking or params.late_chunking is not None:
        raise InvalidInput(f"chunking and late_chunking apply to texts; input {found[0]} is an image")
    if EmbedOutput.SPARSE in params.outputs:
        raise InvalidInput(f"the sparse output is made from texts; input {found[0]} is an image")
    if params.prompt_name and len(found) == len(inputs):
        raise InvalidInput("prompt_name applies to texts, and this call sends only images; leave it unset")


async def encode_inputs(
    core: Core, served: ServedModel, rules: TokenRules, inputs: list, params: EmbedParams
) -> list[InputSequence]:
    """Every input as a sequence, in input order; prompts apply to the texts only."""
    found = image_indices(inputs)
    text_at = [index for index, item in enumerate(inputs) if not isinstance(item, ImageInput)]
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
    rules: TokenRules, vision: VisionSpec, images: list[tuple[int, ImageInput]], params: EmbedParams
) -> list[InputSequence]:
    """Blocking: decode, preprocess and shape each image (an ImageError names the first bad input), with its text
    where it has one."""
    out = []
    for index, image in images:
        rows, grid = prepare_image(image.data, index, vision.processing, vision.limits)
        text = (image.text,) if image.text else ()
        out.append(rules.encode_image(rows, grid, params, *text))
    return out
