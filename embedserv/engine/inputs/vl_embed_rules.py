"""Qwen2-VL / Qwen2.5-VL embedders (GME, DSE) on the host side: every input, a text, an image or an image with
text, framed as one user turn of the Qwen2-VL chat template with the assistant's turn opened and
`<|endoftext|>` after it, the token the model pools (last-token pooling):

    <|im_start|>system\\n{instruction}<|im_end|>\\n<|im_start|>user\\n{image}{text}<|im_end|>\\n
    <|im_start|>assistant\\n<|endoftext|>

where {image} is `<|vision_start|>` + one `<|image_pad|>` per merged patch (t * h * w / merge ** 2 for the
image's grid) + `<|vision_end|>`. This is GME's gme_inference.py framing (Alibaba-NLP/gme-Qwen2-VL-2B-Instruct)
and DSE's (MrLight/dse-qwen2-2b-mrl-v1: the processor's chat template with add_generation_prompt, then
"<|endoftext|>"; the template's default system turn is the same "You are a helpful assistant.").

The instruction: the model's sentence-transformers prompt for the call's prompt_name (or its default prompt),
else "You are a helpful assistant." (GME's default, used for documents; it takes a task instruction for
queries). DSE's cards put "Query: " before a query's text and "What is shown in this image?" after a page
image, and embed a query beside a blank 56x56 placeholder image: a caller sends those as its inputs (an
ImageInput with text), nothing here adds them.

Qwen3-VL embedders (Qwen3-VL-Embedding: its qwen3_vl_embedding.py) frame the same turns without the
`<|endoftext|>` (the processor's chat template with add_generation_prompt; the last token is the assistant
turn's newline), their default instruction "Represent the user's input.", and an instruction not ending in
punctuation gets a "." (QWEN3_VL_FRAMING).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules, VisionSpec
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.errors import ConfigError, InvalidInput
from embedserv.types import EmbedParams, TruncationDirection

DEFAULT_INSTRUCTION = "You are a helpful assistant."
_SYSTEM = "<|im_start|>system\n"
_USER = "<|im_end|>\n<|im_start|>user\n"
_IMAGE_START, _IMAGE_PAD, _IMAGE_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


@dataclass(frozen=True)
class VlFraming:
    """What differs between the embedders' frames: the instruction without a prompt, what ends the input, and
    whether an instruction gets a "." when it ends in no punctuation."""

    default_instruction: str
    end: str
    punctuate: bool = False

    def instruction(self, prompt: str | None) -> str:
        text = (prompt or "").strip() if self.punctuate else prompt
        if not text:
            return self.default_instruction
        if self.punctuate and not unicodedata.category(text[-1]).startswith("P"):
            return text + "."
        return text


GME_FRAMING = VlFraming(DEFAULT_INSTRUCTION, "<|im_end|>\n<|im_start|>assistant\n<|endoftext|>")
QWEN3_VL_FRAMING = VlFraming("Represent the user's input.", "<|im_end|>\n<|im_start|>assistant\n", punctuate=True)
# The families these rules frame inputs for (models/families/qwen2_vl.py, qwen2_5_vl.py, qwen3_vl.py).
FRAMINGS = {"qwen2_vl": GME_FRAMING, "qwen2_5_vl": GME_FRAMING, "qwen3_vl": QWEN3_VL_FRAMING}
FAMILIES = tuple(FRAMINGS)


class VlEmbedRules(TokenRules):
    """Texts, images and images with text of a Qwen2-VL-style embedder; `merge`: its tower's spatial merge."""

    takes_image_text = True

    def __init__(
        self, tokenizer: TextTokenizer, merge: int, vision: VisionSpec | None, framing: VlFraming = GME_FRAMING
    ) -> None:
        super().__init__(vision=vision)
        self.tokenizer = tokenizer
        self.merge = merge
        self.framing = framing
        ids = {token: tokenizer.token_id(token) for token in (_IMAGE_START, _IMAGE_PAD, _IMAGE_END)}
        missing = [token for token, id_ in ids.items() if id_ is None]
        if missing:
            raise ConfigError(f"the tokenizer lacks the image tokens {', '.join(missing)}")
        self.image_token_id = ids[_IMAGE_PAD]
        self._image_start, self._image_end = ids[_IMAGE_START], ids[_IMAGE_END]
        self._end = tokenizer.encode_text(framing.end)
        self._heads: dict[str, list[int]] = {}

    def text_encoder(self, tokenizer: TextTokenizer) -> Callable[[list[str], EmbedParams], list[InputSequence]]:
        return partial(self.encode_texts, tokenizer)

    def encode_texts(self, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> list[InputSequence]:
        return [InputSequence(ids=self._framed([], text, params, f"input {i}")) for i, text in enumerate(texts)]

    def encode_image(
        self, rows: np.ndarray, grid: tuple[int, ...], params: EmbedParams, text: str = ""
    ) -> InputSequence:
        count = int(np.prod(grid)) // self.merge**2
        image = [self._image_start] + [self.image_token_id] * count + [self._image_end]
        ids = self._framed(image, text, params, "an image")
        return InputSequence(ids=ids, pixels=rows, image_grids=(tuple(grid),))

    def _head(self, params: EmbedParams) -> list[int]:
        """The system turn with the call's instruction and the user turn's opening, tokenized once per instruction."""
        instruction = self.framing.instruction(self.tokenizer.resolve_prompt(params.prompt_name))
        if instruction not in self._heads:
            self._heads[instruction] = self.tokenizer.encode_text(f"{_SYSTEM}{instruction}{_USER}")
        return self._heads[instruction]

    def _framed(self, image: list[int], text: str, params: EmbedParams, what: str) -> list[int]:
        """The frame around the image's tokens and the text's; a text too long for the model's limit beside the
        rest is cut (params.truncate) or refused."""
        head = self._head(params)
        ids = self.tokenizer.encode_text(text) if text else []
        if self.image_token_id in ids:
            raise InvalidInput(f"{what} holds the image token {_IMAGE_PAD!r} in its text; send images as images")
        room = self.tokenizer.max_input_tokens - len(head) - len(image) - len(self._end)
        if len(ids) > max(room, 0):
            if not params.truncate or room <= 0:
                total = len(head) + len(image) + len(ids) + len(self._end)
                raise self.tokenizer.too_long(what, total, self.tokenizer.max_input_tokens)
            ids = ids[-room:] if params.truncation_direction is TruncationDirection.LEFT else ids[:room]
        return head + image + ids + self._end
