"""Picks each sequence's next token from its logits, on the device, in one pass for the whole step.

Greedy rows take the argmax. Sampled rows scale by their temperature, cut to top_k and top_p, and draw
with the exponential race (argmax of p / E, E ~ Exp(1)), which picks token i with probability p_i. A
seeded row draws its noise from a generator seeded with (seed, known length): the same request gives the
same tokens whatever it is batched with, and after preemption it continues the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from embedserv.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15
# Greedy on CPU: the vocabulary is scanned in slices of this many logits (see `greedy_tokens`).
_ARGMAX_SLICE = 256


def step_seed(seed: int, length: int) -> int:
    """A 63-bit seed for the draw that follows `length` known tokens."""
    return ((seed * _MIX) ^ (length * 0xBF58476D1CE4E5B9)) & (2**63 - 1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], lengths: Sequence[int]) -> torch.Tensor:
    """[num_rows, vocab] float32 logits -> [num_rows] int64 token ids."""
    greedy = greedy_tokens(logits)
    if all(p.is_greedy for p in params):
        return greedy
    device = logits.device
    temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    scaled = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        scaled = _cut(scaled, params)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, (p, length) in enumerate(zip(params, lengths, strict=True)):
        if p.seed is not None and not p.is_greedy:
            generator = torch.Generator(device=device).manual_seed(step_seed(p.seed, length))
            noise[row].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.is_greedy for p in params], device=device)
    return torch.where(is_greedy, greedy, sampled)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the first maximum of each row. On CPU torch's argmax scans at a tenth of
    amax's speed (128 rows of a 30k vocabulary: 2.1 ms against 0.2 ms, one thread), so there the row's
    largest slice maximum is found with amax, and argmax runs only in the first slice that holds it."""
    _rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab <= _ARGMAX_SLICE:
        return logits.argmax(dim=-1)
    whole = vocab // _ARGMAX_SLICE * _ARGMAX_SLICE
    peaks = logits[:, :whole].unflatten(1, (-1, _ARGMAX_SLICE)).amax(dim=-1)
    if whole < vocab:
        peaks = torch.cat((peaks, logits[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
    start = peaks.argmax(dim=-1) * _ARGMAX_SLICE
    # The last slice may be short: its columns past the vocabulary repeat the last logit, after it.
    columns = (start[:, None] + torch.arange(_ARGMAX_SLICE, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, columns).argmax(dim=-1)


def _cut(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """-inf outside each row's top_k, then outside its top_p of what is left (transformers' order); the
    most likely token always stays."""
    vocab = logits.shape[-1]
    device = logits.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    ordered, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    ordered = ordered.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    # A token stays while the tokens above it hold less than top_p; rows with top_p 1 cut nothing here.
    above = probs.cumsum(dim=-1) - probs
    cut = (above >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.empty_like(logits).scatter_(-1, order, ordered.masked_fill(cut, float("-inf")))
