"""Qwen2-VL / Qwen2.5-VL embedders (GME, DSE) on the host side: every input, a text, an image, an image with
text, or texts and images interleaved in any order, framed as one user turn of the Qwen2-VL chat template with
the assistant's turn opened and `<|endoftext|>` after it, the token the model pools (last-token pooling):

    <|im_start|>system\\n{instruction}<|im_end|>\\n<|im_start|>user\\n{parts}<|im_end|>\\n
    <|im_start|>assistant\\n<|endoftext|>

where {parts} are the input's parts in order, as the chat template renders a user message's content list: a
text as it is (adjacent texts joined), an image as `<|vision_start|>` + one `<|image_pad|>` per merged patch
(t * h * w / merge ** 2 for the image's grid) + `<|vision_end|>`. This is GME's gme_inference.py framing
(Alibaba-NLP/gme-Qwen2-VL-2B-Instruct) and DSE's (MrLight/dse-qwen2-2b-mrl-v1: the processor's chat template with
add_generation_prompt, then "<|endoftext|>"; the template's default system turn is the same "You are a helpful
assistant."). An input holds at most MAX_IMAGES_PER_INPUT images; one too long for the model is refused, or with
truncate its texts are cut (never inside an image's tokens; VlEmbedRules._fit says which).

The instruction: the model's sentence-transformers prompt for the call's prompt_name (or its default prompt),
else "You are a helpful assistant." (GME's default, used for documents; it takes a task instruction for
queries). DSE's cards put "Query: " before a query's text and "What is shown in this image?" after a page
image, and embed a query beside a blank 56x56 placeholder image: a caller sends those as its inputs (an
ImageInput with text), nothing here adds them.

Qwen3-VL embedders (Qwen3-VL-Embedding: its qwen3_vl_embedding.py) frame the same turns without the
`<|endoftext|>` (the processor's chat template with add_generation_prompt; the last token is the assistant
turn's newline), their default instruction "Represent the user's input.", and an instruction not ending in
punctuation gets a "." (QWEN3_VL_FRAMING). That library also sizes every image itself, whatever the checkpoint's
preprocessor_config.json says: qwen_vl_utils resizes it to between 4 and 1,800 blocks of 32 x 32 pixels (merged
patches), then the processor runs with do_resize off (VlFraming.pixels).
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from embedserv.engine.inputs.images import ImageProcessing
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules, VisionSpec
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.errors import ConfigError, InvalidInput
from embedserv.types import EmbedParams, TruncationDirection

DEFAULT_INSTRUCTION = "You are a helpful assistant."
SYSTEM = "<|im_start|>system\n"
USER = "<|im_end|>\n<|im_start|>user\n"
IMAGE_START, IMAGE_PAD, IMAGE_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# An image in a chat template's output, before its one <|image_pad|> becomes one per merged patch.
IMAGE = IMAGE_START + IMAGE_PAD + IMAGE_END


class VlImageTokens:
    """A Qwen2-VL-style tokenizer's image tokens: an image's placeholder ids (`<|vision_start|>`, one `<|image_pad|>`
    per merged patch: t * h * w / merge ** 2 for the image's grid, `<|vision_end|>`), and the refusal of a text
    holding the image token. `merge`: the vision tower's spatial merge."""

    def __init__(self, tokenizer: TextTokenizer, merge: int) -> None:
        ids = {token: tokenizer.token_id(token) for token in (IMAGE_START, IMAGE_PAD, IMAGE_END)}
        missing = [token for token, id_ in ids.items() if id_ is None]
        if missing:
            raise ConfigError(f"the tokenizer lacks the image tokens {', '.join(missing)}")
        self.pad_id: int = ids[IMAGE_PAD]
        self.start_id: int = ids[IMAGE_START]
        self.end_id: int = ids[IMAGE_END]
        self.merge = merge

    def count(self, grid: tuple[int, ...]) -> int:
        """The image's placeholders: its merged patches."""
        return int(np.prod(grid)) // self.merge**2

    def placeholder(self, grid: tuple[int, ...]) -> list[int]:
        return [self.start_id] + [self.pad_id] * self.count(grid) + [self.end_id]

    def check_text(self, ids: list[int], what: str, images: int = 0) -> None:
        """Refuses ids of `what` holding more image tokens than the `images` placed in them (one pad each)."""
        if ids.count(self.pad_id) > images:
            raise InvalidInput(f"{what} holds the image token {IMAGE_PAD!r} in its text; send images as images")


# Images one input may hold (each its own tokens and tower pass; more would crowd out the texts beside them).
MAX_IMAGES_PER_INPUT = 16

# A part of an input as these rules take it: a text, or an image's (patch rows, grid) (engine/inputs/images).
Part = str | tuple[np.ndarray, tuple[int, ...]]


@dataclass(frozen=True)
class VlFraming:
    """What differs between the embedders' frames: the instruction without a prompt, what ends the input, and
    whether an instruction gets a "." when it ends in no punctuation."""

    default_instruction: str
    end: str
    punctuate: bool = False
    # (min, max) pixels per image, the bounds its library resizes to in place of preprocessor_config.json's; None:
    # the checkpoint's.
    pixels: tuple[int, int] | None = None

    def instruction(self, prompt: str | None) -> str:
        text = (prompt or "").strip() if self.punctuate else prompt
        if not text:
            return self.default_instruction
        if self.punctuate and not unicodedata.category(text[-1]).startswith("P"):
            return text + "."
        return text


GME_FRAMING = VlFraming(DEFAULT_INSTRUCTION, "<|im_end|>\n<|im_start|>assistant\n<|endoftext|>")
# qwen3_vl_embedding.py's MIN_PIXELS and MAX_PIXELS: 4 and 1,800 merged 32 x 32 blocks.
QWEN3_VL_FRAMING = VlFraming(
    "Represent the user's input.",
    "<|im_end|>\n<|im_start|>assistant\n",
    punctuate=True,
    pixels=(4 * 32**2, 1800 * 32**2),
)
# The families these rules frame inputs for (models/families/qwen2_vl.py, qwen2_5_vl.py, qwen3_vl.py).
FRAMINGS = {"qwen2_vl": GME_FRAMING, "qwen2_5_vl": GME_FRAMING, "qwen3_vl": QWEN3_VL_FRAMING}
FAMILIES = tuple(FRAMINGS)


def sized_as_its_library(processing: ImageProcessing, pixels: tuple[int, int] | None) -> ImageProcessing:
    """`processing` with the (min, max) pixels a model's own library resizes images to (an embedder's framing's,
    a vision-language reranker's template's); None: the checkpoint's bounds."""
    return processing if pixels is None else dataclasses.replace(processing, resize=("pixels", *pixels))


class VlEmbedRules(TokenRules):
    """Texts, images and texts and images interleaved of a Qwen2-VL-style embedder; `merge`: its tower's spatial
    merge."""

    takes_interleaved = True

    def __init__(
        self, tokenizer: TextTokenizer, merge: int, vision: VisionSpec | None, framing: VlFraming = GME_FRAMING
    ) -> None:
        super().__init__(vision=vision)
        self.tokenizer = tokenizer
        self.framing = framing
        self.images = VlImageTokens(tokenizer, merge)
        self.image_token_id = self.images.pad_id
        self._end = tokenizer.encode_text(framing.end)
        self._heads: dict[str, list[int]] = {}

    def text_encoder(self, tokenizer: TextTokenizer) -> Callable[[list[str], EmbedParams], list[InputSequence]]:
        return partial(self.encode_texts, tokenizer)

    def encode_texts(self, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> list[InputSequence]:
        return [self.encode_interleaved([text], params, f"input {i}") for i, text in enumerate(texts)]

    def encode_image(
        self, rows: np.ndarray, grid: tuple[int, ...], params: EmbedParams, text: str = ""
    ) -> InputSequence:
        return self.encode_interleaved([(rows, grid), text], params, "an image")

    def encode_interleaved(self, parts: Sequence[Part], params: EmbedParams, what: str) -> InputSequence:
        """One input of texts and images (`what` names it in errors) in the frame: the parts in order, adjacent
        texts joined as the chat template joins them, the images' rows one after another with a grid each."""
        images = [part for part in parts if not isinstance(part, str)]
        if len(images) > MAX_IMAGES_PER_INPUT:
            raise too_many_images(what, len(images))
        segments: list[list[int]] = []
        texts: list[int] = []  # which segments are texts (truncation cuts only those)
        for part in _joined_texts(parts):
            if isinstance(part, str):
                ids = self.tokenizer.encode_text(part)
                self.images.check_text(ids, what)
                texts.append(len(segments))
                segments.append(ids)
            else:
                segments.append(self.images.placeholder(part[1]))
        head = self._head(params)
        self._fit(segments, texts, len(head) + len(self._end), params, what)
        ids = head + [token for segment in segments for token in segment] + self._end
        if not images:
            return InputSequence(ids=ids)
        pixels = images[0][0] if len(images) == 1 else np.concatenate([rows for rows, _ in images])
        return InputSequence(ids=ids, pixels=pixels, image_grids=tuple(tuple(grid) for _, grid in images))

    def _head(self, params: EmbedParams) -> list[int]:
        """The system turn with the call's instruction and the user turn's opening, tokenized once per instruction."""
        instruction = self.framing.instruction(self.tokenizer.resolve_prompt(params.prompt_name))
        if instruction not in self._heads:
            self._heads[instruction] = self.tokenizer.encode_text(f"{SYSTEM}{instruction}{USER}")
        return self._heads[instruction]

    def _fit(self, segments: list[list[int]], texts: list[int], frame: int, params: EmbedParams, what: str) -> None:
        """Within the model's limit: an input too long is refused, or with params.truncate its texts are cut, never
        an image: RIGHT cuts the last text's end first, then the text before it; LEFT the first text's start
        first. An input whose images and frame alone reach the limit is refused either way."""
        limit = self.tokenizer.max_input_tokens
        total = frame + sum(map(len, segments))
        if total <= limit:
            return
        fixed = total - sum(len(segments[i]) for i in texts)
        if fixed >= limit:
            if len(segments) == len(texts):
                raise self.tokenizer.too_long(what, total, limit)
            raise InvalidInput(
                f"{what}: its images and the prompt alone make {fixed} tokens, and the model's limit of {limit} "
                "leaves no room for more; send fewer or smaller images"
            )
        if not params.truncate:
            raise self.tokenizer.too_long(what, total, limit)
        over = total - limit
        left = params.truncation_direction is TruncationDirection.LEFT
        for index in texts if left else reversed(texts):
            cut = min(over, len(segments[index]))
            segments[index] = segments[index][cut:] if left else segments[index][: len(segments[index]) - cut]
            over -= cut
            if not over:
                return


def too_many_images(what: str, count: int) -> InvalidInput:
    return InvalidInput(
        f"{what} holds {count} images; one input takes at most {MAX_IMAGES_PER_INPUT}: send the rest as inputs of "
        "their own"
    )


def _joined_texts(parts: Sequence[Part]) -> list[Part]:
    """The parts with adjacent texts joined into one and empty texts dropped."""
    out: list[Part] = []
    for part in parts:
        if isinstance(part, str):
            if not part:
                continue
            if out and isinstance(out[-1], str):
                part = out.pop() + part
        out.append(part)
    return out
