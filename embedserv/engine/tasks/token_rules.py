"""What is model-specific about token vectors and the inputs they come from: which tokens' vectors a call
gets, and how its inputs are tokenized. The base rules serve every model but late-interaction ones
(multi_vector.py subclasses them); embedding.py picks a model's rules."""

from __future__ import annotations

import numpy as np

from embedserv.engine.tokenizer import Encoded, TextTokenizer
from embedserv.types import EmbedParams


class TokenRules:
    """Token vectors are the vectors of every token but the first `skip_first` (bge-m3's colbert head skips
    the CLS token); inputs are tokenized as for Embed."""

    skip_first = 0

    def __init__(self, skip_first: int = 0) -> None:
        self.skip_first = skip_first

    def encode(self, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> list[Encoded]:
        return tokenizer.encode_batch(texts, params.truncate, params.truncation_direction, params.prompt_name)

    def keep(self, encoded: Encoded, params: EmbedParams) -> np.ndarray | slice:
        """Which of the sequence's token vectors the caller gets: a boolean mask or a slice."""
        return slice(self.skip_first, None)

