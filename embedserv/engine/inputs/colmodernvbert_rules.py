"""ColModernVBERT on the host side: queries and page images as transformers' ColModernVBertProcessor makes them.

Read from the model's processor_config.json (the processor's defaults where it says nothing):
- the processor adds `<fake_token_around_image>`, `<image>` and `<end_of_utterance>` to the tokenizer as special
  tokens when it is built; so do we (tokens the tokenizer has already change nothing);
- a text is a query: `query_prefix + text + "<end_of_utterance>" * 10`, tokenized as `tokenizer(text)` does, with
  the tokenizer's special tokens;
- an image is a page: the visual prompt (`visual_prompt_prefix`) with its `<image>` replaced as
  `replace_image_token` does from the image's tiles (engine/inputs/images/idefics3.py): for rows x cols tiles,
  row by row, each tile `<fake_token_around_image><row_r_col_c>` and image_seq_len `<image>`s, a "\\n" after each
  row, then "\\n" and the global image `<fake_token_around_image><global-img>`, image_seq_len `<image>`s,
  `<fake_token_around_image>`; an image of one frame is the global part alone. Tokenized as a query is. A page's
  ids depend only on its tiles, so each layout is tokenized once;
- every token's vector is returned.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import VisionSpec
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.engine.inputs.vision_retrieval_rules import (
    RetrievalPrompts,
    VisionRetrievalRules,
    saved_processor_config,
)
from embedserv.errors import ConfigError, InvalidInput
from embedserv.types import EmbedParams

ARCHITECTURE = "ColModernVBertForRetrieval"
FAKE_IMAGE = "<fake_token_around_image>"
IMAGE = "<image>"
END_OF_UTTERANCE = "<end_of_utterance>"
GLOBAL_IMAGE = "<global-img>"
DEFAULT_PAGE = f"<|begin_of_text|>User:{IMAGE}Describe the image.{END_OF_UTTERANCE}\nAssistant:"
DEFAULT_IMAGE_SEQ_LEN = 64


def image_text(tiles: tuple[int, int], image_seq_len: int) -> str:
    """ColModernVBertProcessor.replace_image_token for an image of (rows, cols) tiles."""
    rows, cols = tiles
    features = IMAGE * image_seq_len
    whole = f"{FAKE_IMAGE}{GLOBAL_IMAGE}{features}{FAKE_IMAGE}"
    if rows == 0 and cols == 0:
        return whole
    split = "".join(
        "".join(f"{FAKE_IMAGE}<row_{r + 1}_col_{c + 1}>{features}" for c in range(cols)) + "\n" for r in range(rows)
    )
    return f"{split}\n{whole}"


def frame_count(tiles: tuple[int, int]) -> int:
    """The tiles and the global image, or the one frame."""
    return tiles[0] * tiles[1] + 1 if tiles[0] or tiles[1] else 1


class ColModernVBertRules(VisionRetrievalRules):
    """Queries (the base rules' encode_queries, with this processor's prompts) and pages of a ColModernVBERT model."""

    def __init__(self, tokenizer: TextTokenizer, prompts: RetrievalPrompts, vision: VisionSpec, seq_len: int) -> None:
        tokenizer.add_special_tokens([FAKE_IMAGE, IMAGE, END_OF_UTTERANCE])
        super().__init__(tokenizer, prompts, vision)
        self._tokenizer = tokenizer
        self.image_seq_len = seq_len
        self.side = vision.processing.tile_size // vision.patch_size
        self._pages: dict[tuple[int, int], list[int]] = {}
        # The framing's tokens checked at start-up: one frame, and tiles.
        self.page_ids((0, 0))
        self.page_ids((1, 2))

    def page_ids(self, tiles: tuple[int, int]) -> list[int]:
        ids = self._pages.get(tiles)
        if ids is None:
            page = self.prompts.page_text.replace(IMAGE, image_text(tiles, self.image_seq_len), 1)
            ids = self._tokenizer.encode_prompt(page, add_special_tokens=True)
            placeholders = frame_count(tiles) * self.image_seq_len
            if ids.count(self.image_token_id) != placeholders:
                raise ConfigError(
                    f"the tokenizer makes {ids.count(self.image_token_id)} {IMAGE} tokens of a page of {tiles} tiles, "
                    f"not {placeholders}: it splits the processor's image tokens"
                )
            # Layouts are few (tiles per side are bounded by the resize): a benign race at worst tokenizes twice.
            self._pages[tiles] = ids
        return ids

    def encode_image(self, rows: np.ndarray, grid: tuple[int, ...], params: EmbedParams) -> InputSequence:
        """A page of (rows, cols) tiles (images/idefics3.py's grid), whatever the call's prompt_name."""
        tiles = (int(grid[0]), int(grid[1]))
        ids = self.page_ids(tiles)
        if len(ids) > self.max_input_tokens:
            raise InvalidInput(
                f"an image makes {len(ids)} tokens with the page prompt, more than the model's "
                f"{self.max_input_tokens}; send it with fewer pixels"
            )
        frames = frame_count(tiles)
        return InputSequence(ids=list(ids), pixels=rows, image_grids=((frames, self.side, self.side),))


def read_colmodernvbert_rules(
    model_dir: Path, hf_config, tokenizer: TextTokenizer, vision: VisionSpec | None
) -> ColModernVBertRules:
    """The processor's prompts and image_seq_len; refuses a processor whose pages the model cannot take."""
    saved = saved_processor_config(model_dir)
    vlm = hf_config.vlm_config
    tower = vlm.vision_config
    seq_len = int(saved.get("image_seq_len") or DEFAULT_IMAGE_SEQ_LEN)
    side, factor = tower.image_size // tower.patch_size, vlm.pixel_shuffle_factor
    if side % factor:
        raise ConfigError(f"{model_dir}: the vision tower's {side}x{side} patches do not pixel-shuffle by {factor}")
    per_frame = (side // factor) ** 2
    if seq_len != per_frame:
        raise ConfigError(
            f"{model_dir}: processor_config.json's image_seq_len {seq_len} differs from the {per_frame} features the "
            "model makes of each image frame"
        )
    if vision is None or vision.processing.layout != "idefics3":
        raise ConfigError(f"{model_dir}: {ARCHITECTURE} takes Idefics3's image processor (Idefics3ImageProcessor)")
    if vision.processing.tile_size != tower.image_size:
        raise ConfigError(
            f"{model_dir}: the image processor's max_image_size {vision.processing.tile_size} differs from the vision "
            f"tower's image_size {tower.image_size}"
        )
    prompts = RetrievalPrompts(
        query_prefix=saved.get("query_prefix") or "",
        query_start="",
        page_text=saved.get("visual_prompt_prefix") or DEFAULT_PAGE,
        image_token=IMAGE,
        augmentation=END_OF_UTTERANCE,
        query_suffix="",
        special_tokens=True,
    )
    return ColModernVBertRules(tokenizer, prompts, vision, seq_len)
