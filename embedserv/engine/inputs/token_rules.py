"""What is model-specific about token vectors and the inputs they come from: which tokens' vectors a call
gets, and how its inputs (texts, images) become sequences. The base rules serve every model but
late-interaction ones (multi_vector.py subclasses them); embedding.py picks a model's rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embedserv.engine.inputs.images import ImageLimits, ImageProcessing
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.errors import InvalidInput
from embedserv.types import EmbedParams


@dataclass(frozen=True)
class VisionSpec:
    """How a model's images become sequences (engine/tasks/token_rules.TokenRules.encode_image) and how its
    texts are shaped beside them. Models with other image layouts add fields with defaults."""

    processing: ImageProcessing
    # ModelConfig.max_image_bytes / max_image_pixels.
    limits: ImageLimits
    patch_size: int
    # A class-token row (zeros; the model puts its class embedding there) leads each image's patch rows (CLIP).
    class_token: bool = False


class TokenRules:
    """Token vectors are the vectors of every token but the first `skip_first` (bge-m3's colbert head skips
    the CLS token); inputs are tokenized as for Embed. `vision`: a model that takes images (dual encoders:
    each image is a sequence of its patch rows)."""

    skip_first = 0
    vision: VisionSpec | None = None
    # An input may hold text with its image (ImageInput.text: encode_image takes it) and texts and images
    # interleaved (InterleavedInput: encode_interleaved); otherwise an input is a text or an image alone.
    takes_interleaved = False
    # Vision-language models: the placeholder token an image's features take the places of.
    image_token_id: int | None = None

    def __init__(self, skip_first: int = 0, vision: VisionSpec | None = None) -> None:
        self.skip_first = skip_first
        self.vision = vision

    def text_encoder(self, tokenizer: TextTokenizer) -> Callable[[list[str], EmbedParams], list[InputSequence]]:
        """How Embed's texts become sequences: as the tokenizer encodes them (the rules of late-interaction and
        vision-retrieval models frame them their own way). Asked once, when a service is built."""
        return tokenizer.encode_texts

    def encode_image(self, rows: np.ndarray, grid: tuple[int, ...], params: EmbedParams) -> InputSequence:
        """One image's sequence: its patch rows ([rows, patch_dim] float32, engine/inputs/images), a zero row first
        where the model puts its class embedding, and one placeholder token id per row."""
        if self.vision is None:
            raise InvalidInput("this model takes text only; send texts")
        if self.vision.class_token:
            rows = np.concatenate((np.zeros((1, rows.shape[1]), dtype=np.float32), rows))
        return InputSequence(ids=[0] * len(rows), pixels=rows, image_grids=(tuple(grid),))

    def encode_interleaved(self, parts: list, params: EmbedParams, what: str) -> InputSequence:
        """Texts and images interleaved in one input (`parts`: texts, and images' (rows, grid)), for models that
        say `takes_interleaved`; engine/inputs/image_inputs.check_call refuses them for the rest."""
        raise InvalidInput(
            f"{what}: this model takes one text or one image per input; send each as an input of its own"
        )

    def check_ids(self, encoded: list[InputSequence]) -> None:
        """Refuses token-id inputs (used as given) that the model cannot take: every id in the vocabulary but a
        vision-language model's image token, which takes an image's features (an input of ids with it but no
        image would leave the model more placeholders than features in the step)."""
        if self.image_token_id is None:
            return
        for index, item in enumerate(encoded):
            if self.image_token_id in item.ids:
                raise InvalidInput(
                    f"input {index} holds the image token id {self.image_token_id}; send images as images"
                )

    def keep(self, encoded: InputSequence, params: EmbedParams) -> np.ndarray | slice:
        """Which of the sequence's token vectors the caller gets: a boolean mask or a slice."""
        return slice(self.skip_first, None)
