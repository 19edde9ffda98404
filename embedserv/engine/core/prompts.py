"""A Generate request's prompt, checked and tokenized for GenerationStreams (generation.py): its token ids, the
detokenizer its stream's text comes from, and an encoder-decoder model's encoder input."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from embedserv.engine.core.detokenizer import IncrementalDetokenizer
from embedserv.engine.inputs.tokenizer import TextTokenizer, TokenizerPool
from embedserv.errors import InvalidInput
from embedserv.types import SamplingParams, TruncationDirection


def check_sampling(params: SamplingParams) -> None:
    if params.max_tokens is not None and params.max_tokens < 1:
        raise InvalidInput(f"max_tokens must be at least 1, not {params.max_tokens}")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise InvalidInput(f"temperature must be 0 (greedy) or above, not {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], not {params.top_p}")
    if params.top_k < 0:
        raise InvalidInput(f"top_k must be 0 (no cut) or above, not {params.top_k}")
    if any(not s for s in params.stop):
        raise InvalidInput("stop strings must not be empty")


@dataclass(frozen=True)
class PreparedPrompt:
    # The decoder's prompt: the whole prompt of a decoder-only model; an encoder-decoder model's decoder
    # start token and its `decoder_prompt`.
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    # An encoder-decoder model's encoder input (the request's prompt); empty for decoder-only models.
    encoder_token_ids: list[int] = field(default_factory=list)


async def prepare_prompt(
    tokenizer: TextTokenizer,
    pool: TokenizerPool,
    prompt: str | list[int],
    params: SamplingParams,
    decoder_prompt: str = "",
    decoder_start_token_id: int | None = None,
    add_special_tokens: bool = True,
) -> PreparedPrompt:
    """Checks a Generate request and tokenizes it in the tokenizer pool (both decode).

    With `decoder_start_token_id` (encoder-decoder models) the prompt, with the model's special tokens,
    is the encoder's input, and the decoder starts from that token followed by `decoder_prompt`'s tokens
    (no special tokens), as transformers' generate does with decoder_input_ids."""
    if not prompt:
        raise InvalidInput("prompt is empty; send the text to continue")
    check_sampling(params)

    def prepare() -> PreparedPrompt:
        if isinstance(prompt, list):
            (encoded,) = tokenizer.check_token_ids([prompt], truncate=False, direction=TruncationDirection.RIGHT)
            token_ids = encoded.ids
        else:
            token_ids = tokenizer.encode_prompt(prompt, add_special_tokens)
        if not token_ids:
            raise InvalidInput("the prompt has no tokens for this model's tokenizer; send some text")
        if decoder_start_token_id is None:
            return PreparedPrompt(token_ids, IncrementalDetokenizer(tokenizer.hf_tokenizer, token_ids, params.stop))
        if len(token_ids) > tokenizer.max_input_tokens:
            raise InvalidInput(
                f"the prompt has {len(token_ids)} tokens, more than the model's encoder limit of "
                f"{tokenizer.max_input_tokens}; shorten it"
            )
        decoder_ids = [decoder_start_token_id] + (tokenizer.encode_text(decoder_prompt) if decoder_prompt else [])
        detokenizer = IncrementalDetokenizer(tokenizer.hf_tokenizer, decoder_ids, params.stop)
        return PreparedPrompt(decoder_ids, detokenizer, token_ids)

    return await pool.run(prepare, (), None)
