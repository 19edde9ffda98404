"""The sampler: greedy argmax, temperature, top_k / top_p as transformers' warpers cut, seeded draws."""

import pytest
import torch

from embedserv.models.heads.sampler import _cut, greedy_tokens, sample
from embedserv.types import SamplingParams


def _logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = _logits()
    params = [
        SamplingParams(1),
        SamplingParams(1, temperature=1.0),
        SamplingParams(1),
        SamplingParams(1, temperature=2.0),
    ]
    out = sample(logits, params, [5] * 4)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


@pytest.mark.parametrize("vocab", [30522, 256, 257, 513, 100])
def test_greedy_tokens_are_argmax_with_its_ties(vocab):
    """The sliced scan (CPU) picks argmax's token: the first maximum, also in a short last slice and
    where a maximum repeats across slices."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        logits = torch.randn(9, vocab, generator=gen)
        if trial % 3 == 0:
            logits = torch.randint(0, 3, (9, vocab), generator=gen).float()
        if trial % 4 == 1:
            logits[:, -1] = logits[:, 0] = 50.0
        if trial % 4 == 2:
            logits[::2, -1] = 60.0
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1)), trial


def test_top_k_and_top_p_keep_what_transformers_keeps():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = _logits(rows=3)
    for top_k, top_p in [(5, 1.0), (0, 0.7), (10, 0.5), (0, 0.05)]:
        params = [SamplingParams(1, temperature=1.0, top_k=top_k, top_p=top_p)] * 3
        ours = torch.isfinite(_cut(logits, params))
        expected = logits
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        assert torch.equal(ours, torch.isfinite(expected)), (top_k, top_p)
        assert ours.sum(dim=1).min() >= 1


def test_draws_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    probs = logits.softmax(-1)[0]
    torch.manual_seed(0)
    draws = torch.stack([sample(logits, [SamplingParams(1, temperature=1.0)], [1]) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=4).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


def test_top_k_one_is_greedy_and_a_cut_token_never_comes():
    logits = _logits(rows=1)
    torch.manual_seed(1)
    for _ in range(50):
        assert sample(logits, [SamplingParams(1, temperature=5.0, top_k=1)], [3])[0] == logits[0].argmax()
    kept = set(logits[0].topk(3).indices.tolist())
    assert {int(sample(logits, [SamplingParams(1, temperature=5.0, top_k=3)], [3])[0]) for _ in range(100)} <= kept


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_a_seed_fixes_the_draw_whatever_the_batch(temperature):
    logits = _logits(rows=4, vocab=1000)
    seeded = SamplingParams(1, temperature=temperature, seed=42)
    alone = sample(logits[2:3], [seeded], [17])
    torch.manual_seed(123)  # the global generator must not matter for seeded rows
    batched = sample(logits, [SamplingParams(1, temperature=1.0)] * 2 + [seeded, SamplingParams(1)], [3, 4, 17, 5])
    assert batched[2] == alone[0]
    other_steps = {int(sample(logits[2:3], [seeded], [n])[0]) for n in range(18, 40)}
    assert len(other_steps) > 1, "each position must draw fresh noise"
