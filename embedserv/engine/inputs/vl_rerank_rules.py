"""Qwen3-VL-Reranker's inputs on the host side: one sequence per (query, document) pair, as its
scripts/qwen3_vl_reranker.py builds the messages and Qwen3-VL's chat template renders them with
add_generation_prompt:

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n<Instruct>: {instruction}<Query>:{query}
    \\n<Document>:{document}<|im_end|>\\n<|im_start|>assistant\\n

(no newline at the line break above). Each side is its image (vl_embed_rules.VlImageTokens' placeholder) then its
text, or "NULL" when it has neither. The yes/no head reads the last token. The prompt is tokenized whole, as the
processor tokenizes the template's output; the image tokens are special, so the texts on either side of an image
are tokenized apart, as there.

A pair holds the query's image and the document's, each side at most one (the script's format: a side is a text,
an image, or an image with text); the sequence carries their patch rows one after another with a grid each. A
prompt past the model's limit is refused, or with truncate its document's text is cut from the end; never the
query, the instruction or an image. (The script keeps every special token and the
first text tokens that fit: the same cut, but that where the document's text is shorter than the excess it cuts the
query's text too, which is refused here.)

Image decode errors name the query "input 0" and document i "input i + 1", as the other Rerank paths number them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tokenizers

from embedserv.engine.inputs.images import prepare_image
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules, VisionSpec
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.engine.inputs.vl_embed_rules import IMAGE, QWEN3_VL_FRAMING, SYSTEM, USER, VlImageTokens
from embedserv.errors import InvalidInput
from embedserv.models.loading.tasks import VlYesNoTemplate
from embedserv.types import ImageInput

# The script's content parts around the query and the document, and a side's text when it has nothing.
INSTRUCT, QUERY, DOCUMENT, EMPTY = "<Instruct>: ", "<Query>:", "\n<Document>:", "NULL"


@dataclass(frozen=True)
class _Side:
    """The query or a document as the prompt holds it: its image's patch rows and grid (none: no image), its text."""

    text: str
    rows: np.ndarray | None = None
    grid: tuple[int, ...] = ()

    @property
    def prompt(self) -> str:
        if self.rows is None:
            return self.text or EMPTY
        return IMAGE + self.text


class VlRerankRules(TokenRules):
    """The pairs of a vision-language yes/no reranker; `merge`: its tower's spatial merge."""

    def __init__(
        self, tokenizer: TextTokenizer, merge: int, vision: VisionSpec | None, template: VlYesNoTemplate
    ) -> None:
        super().__init__(vision=vision)
        self.tokenizer = tokenizer
        self.template = template
        self.images = VlImageTokens(tokenizer, merge)
        self.image_token_id = self.images.pad_id
        self._end = tokenizer.encode_text(QWEN3_VL_FRAMING.end)

    def encode_pairs(
        self, query: str | ImageInput, documents: list[str | ImageInput], instruction: str, truncate: bool
    ) -> list[InputSequence]:
        """Blocking (images are decoded here): each document's prompt with the query, in document order."""
        asked = self._side(query, 0)
        if asked.text:
            self.images.check_text(self.tokenizer.encode_text(asked.text), "the query")
        head = f"{SYSTEM}{self.template.system}{USER}{INSTRUCT}{instruction}{QUERY}{asked.prompt}{DOCUMENT}"
        sides = [self._side(document, index + 1) for index, document in enumerate(documents)]
        prompts = [head + side.prompt for side in sides]
        encodings = self.tokenizer.backend.encode_batch(prompts, add_special_tokens=False)
        return [
            self._sequence(encoding, head, asked, side, index, truncate)
            for index, (encoding, side) in enumerate(zip(encodings, sides, strict=True))
        ]

    def _side(self, item: str | ImageInput, index: int) -> _Side:
        if not isinstance(item, ImageInput):
            return _Side(item)
        if self.vision is None:
            raise InvalidInput("this model takes text only; send texts")
        rows, grid = prepare_image(item.data, index, self.vision.processing, self.vision.limits)
        return _Side(item.text, rows, tuple(grid))

    def _sequence(
        self, encoding: tokenizers.Encoding, head: str, query: _Side, document: _Side, index: int, truncate: bool
    ) -> InputSequence:
        """One pair's ids, each image's one `<|image_pad|>` made one per merged patch (the query's, then the
        document's); cut or refused when too long."""
        images = [side for side in (query, document) if side.rows is not None]
        self.images.check_text(encoding.ids, f"document {index}", images=len(images))
        # The placeholders the images add past the one pad each the prompt holds.
        extra = sum(self.images.count(image.grid) - 1 for image in images)
        limit = self.tokenizer.max_input_tokens
        room = limit - len(self._end) - extra
        if len(encoding.ids) > room:
            if not truncate:
                total = len(encoding.ids) + limit - room
                raise self.tokenizer.too_long(f"the prompt for document {index}", total, limit)
            self._check_room(head, document, index, room)
            encoding.truncate(room, direction="right")
        ids = encoding.ids
        if not images:
            return InputSequence(ids=ids + self._end)
        pads = [at for at, token in enumerate(ids) if token == self.images.pad_id]  # one per image, in order
        for at, image in reversed(list(zip(pads, images, strict=True))):  # from the end: earlier places hold
            ids = ids[:at] + [self.images.pad_id] * self.images.count(image.grid) + ids[at + 1 :]
        rows = [image.rows for image in images if image.rows is not None]
        pixels = rows[0] if len(rows) == 1 else np.concatenate(rows)
        return InputSequence(ids=ids + self._end, pixels=pixels, image_grids=tuple(image.grid for image in images))

    def _check_room(self, head: str, document: _Side, index: int, room: int) -> None:
        """Refuses a prompt whose parts before the document's text leave that text no room: only it is cut."""
        before = head + (IMAGE if document.rows is not None else "")
        fixed = len(self.tokenizer.encode_text(before))
        if fixed >= room:
            limit = self.tokenizer.max_input_tokens
            parts, change = "the prompt, the instruction and the query", "shorten the query or the instruction"
            if document.rows is not None:
                parts, change = f"{parts} with document {index}'s image", f"{change}, or send a smaller image"
            raise InvalidInput(
                f"{parts} take {fixed + limit - room} tokens of the model's limit of {limit}, which leaves no room for "
                f"document {index}'s text; {change}"
            )
