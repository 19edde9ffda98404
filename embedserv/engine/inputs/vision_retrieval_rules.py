"""ColQwen2 and ColPali on the host side: queries and page images as their processors make them, every token's
vector returned (MaxSim rerank of page images: engine/tasks/vision_retrieval.py).

As transformers' ColQwen2Processor / ColPaliProcessor (process_queries, process_images) do, read from the
model's processor_config.json (their defaults where it says nothing):
- a text is a query: `query_prefix + text + augmentation + "\\n"` (ColPali puts the tokenizer's BOS first), the
  augmentation being ten of the tokenizer's pad token; tokenized without special tokens added, as both
  processors leave them out;
- an image is a page: the visual prompt with its one image placeholder repeated as many times as the image
  gives language-model tokens (ColQwen2: its patches over the merge block, t * h * w / merge ** 2; ColPali:
  image_seq_length, the tower's fixed patch count); the patch rows travel with it (engine/inputs/images prepares them);
- every token's vector is returned (transformers returns the attention-masked ones: all of an unpadded input).
Prompt names: "query" (or none) for texts; images are always documents.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.errors import ConfigError, InvalidInput
from embedserv.types import EmbedParams

QUERY = "query"
# Their head kind (models/registry.HEAD_KINDS).
VISION_RETRIEVAL = "vision_retrieval"
# The query augmentation: this many of the tokenizer's pad token after the query (both processors' default).
AUGMENTATION_TOKENS = 10


@dataclass(frozen=True)
class RetrievalPrompts:
    """How a ColPali-style processor frames queries and pages."""

    query_prefix: str
    # Text before the query prefix (ColPali: the BOS token).
    query_start: str
    # The page text with one image placeholder in it.
    page_text: str
    image_token: str
    # ColQwen2's spatial merge: an image gives t * h * w / merge ** 2 language-model tokens.
    merge: int = 0
    # ColPali's fixed count (0: from the grid and merge).
    image_seq_length: int = 0
    # The query augmentation token ("": the tokenizer's pad token), what ends a query, and whether queries are
    # tokenized with the tokenizer's special tokens (ColModernVBERT's processor tokenizes them as `tokenizer(text)`).
    augmentation: str = ""
    query_suffix: str = "\n"
    special_tokens: bool = False

    def tokens_for(self, grid: tuple[int, ...]) -> int:
        return self.image_seq_length or math.prod(grid) // self.merge**2


def saved_processor_config(model_dir: Path) -> dict:
    """processor_config.json's settings, or none."""
    path = Path(model_dir) / "processor_config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def read_retrieval_prompts(model_dir: Path, architecture: str, hf_config, tokenizer: TextTokenizer) -> RetrievalPrompts:
    """The processor's prompts from processor_config.json (else its defaults), for ColQwen2 or ColPali."""
    saved = saved_processor_config(model_dir)
    hf = tokenizer.hf_tokenizer
    if architecture == "ColQwen2ForRetrieval":
        image_token = getattr(hf, "image_token", None) or "<|image_pad|>"
        page = saved.get("visual_prompt_prefix") or (
            f"<|im_start|>user\n<|vision_start|>{image_token}<|vision_end|>Describe the image.<|im_end|><|endoftext|>"
        )
        merge = int(hf_config.vlm_config.vision_config.spatial_merge_size)
        return RetrievalPrompts(saved.get("query_prefix") or "Query: ", "", page, image_token, merge=merge)
    bos = hf.bos_token or ""
    image_token = getattr(hf, "image_token", None) or "<image>"
    page = f"{image_token}{bos}{saved.get('visual_prompt_prefix') or 'Describe the image.'}\n"
    seq_length = int(hf_config.vlm_config.text_config.num_image_tokens)
    query_prefix = saved.get("query_prefix") or "Question: "
    return RetrievalPrompts(query_prefix, bos, page, image_token, image_seq_length=seq_length)


class VisionRetrievalRules(TokenRules):
    """Queries and page images of a ColQwen2 or ColPali model; `vision` is the served model's VisionSpec."""

    def __init__(self, tokenizer: TextTokenizer, prompts: RetrievalPrompts, vision=None) -> None:
        super().__init__(vision=vision)
        self.prompts = prompts
        self.max_input_tokens = tokenizer.max_input_tokens
        hf = tokenizer.hf_tokenizer
        if not prompts.augmentation and hf.pad_token is None:
            raise ConfigError("the tokenizer has no pad token, which queries are augmented with")
        self._augmentation = (prompts.augmentation or hf.pad_token) * AUGMENTATION_TOKENS
        self.image_token_id = tokenizer.token_id(prompts.image_token)
        if self.image_token_id is None:
            raise ConfigError(f"the tokenizer lacks the image token {prompts.image_token!r}")
        page = tokenizer.encode_text(prompts.page_text)
        if page.count(self.image_token_id) != 1:
            raise ConfigError(f"the visual prompt {prompts.page_text!r} must hold the image token once")
        at = page.index(self.image_token_id)
        # Tokenized once whole (the placeholder splits nothing around it), then expanded per image.
        self._page_head, self._page_tail = page[:at], page[at + 1 :]

    def text_encoder(self, tokenizer: TextTokenizer) -> Callable[[list[str], EmbedParams], list[InputSequence]]:
        return partial(self.encode, tokenizer)

    def encode(self, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> list[InputSequence]:
        if params.prompt_name not in (None, QUERY):
            raise InvalidInput(f"texts are queries for this model: prompt_name must be {QUERY!r} or unset")
        return self.encode_queries(tokenizer, texts)

    def encode_queries(self, tokenizer: TextTokenizer, texts: list[str], what: str = "input {}") -> list[InputSequence]:
        """Queries as process_queries makes them; `what` names an input in errors (formatted with its index)."""
        p = self.prompts
        out = []
        for index, text in enumerate(texts):
            query = f"{p.query_start}{p.query_prefix}{text}{self._augmentation}{p.query_suffix}"
            ids = tokenizer.encode_prompt(query, add_special_tokens=p.special_tokens)
            if self.image_token_id in ids:
                raise InvalidInput(
                    f"{what.format(index)} holds the image token {p.image_token!r}; send images as images"
                )
            if len(ids) > self.max_input_tokens:
                raise InvalidInput(
                    f"{what.format(index)} has {len(ids)} tokens with the query prompt, more than the model's "
                    f"{self.max_input_tokens}; shorten it"
                )
            out.append(InputSequence(ids=ids))
        return out

    def encode_image(self, rows: np.ndarray, grid: tuple[int, ...], params: EmbedParams) -> InputSequence:
        """A page, whatever the call's prompt_name (it names the texts' task)."""
        count = self.prompts.tokens_for(tuple(grid))
        ids = self._page_head + [self.image_token_id] * count + self._page_tail
        if len(ids) > self.max_input_tokens:
            # Only a model whose processor allows more image tokens than its input limit gets here.
            raise InvalidInput(
                f"an image makes {len(ids)} tokens with the page prompt, more than the model's "
                f"{self.max_input_tokens}; send it with fewer pixels"
            )
        return InputSequence(ids=ids, pixels=rows, image_grids=(tuple(grid),))

    def keep(self, encoded: InputSequence, params: EmbedParams) -> np.ndarray | slice:
        return slice(None)
