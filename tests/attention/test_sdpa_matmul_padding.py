"""The sdpa backend's bfloat16 matmul attention pads its lengths to a multiple of 8 (oneDNN keeps a primitive
per matmul shape; unpadded, every length churned its caches and grew the worker's heap). Padded keys must be
masked and padded queries dropped: the result is the unpadded attention, with or without a causal mask, a
boolean mask, a float bias, grouped-query heads and unequal query and key lengths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embedserv.attention.backends import sdpa


def _inputs(n: int, heads: int, kv_heads: int, len_q: int, len_k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, len_q, 32, generator=generator)
    k, v = (torch.randn(n, kv_heads, len_k, 32, generator=generator) for _ in range(2))
    return q, k, v


def _reference(q, k, v, is_causal: bool, mask) -> torch.Tensor:
    """float32 SDPA; a causal mask aligned at the end (queries are the last len_q keys)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    len_q, len_k = q.shape[2], k.shape[2]
    if is_causal:
        mask = torch.ones(len_q, len_k, dtype=torch.bool).tril(len_k - len_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=32**-0.5)


@pytest.mark.parametrize(
    "len_q, len_k, is_causal", [(65, 65, True), (100, 100, False), (71, 130, False), (64, 64, True), (70, 90, True)]
)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_padded_matmuls_equal_the_unpadded_attention(len_q, len_k, is_causal, kv_heads):
    q, k, v = _inputs(3, 4, kv_heads, len_q, len_k)
    got = sdpa._attend_with_matmuls(q.bfloat16(), k.bfloat16(), v.bfloat16(), 32**-0.5, is_causal)
    assert got.shape == q.shape
    torch.testing.assert_close(got.float(), _reference(q, k, v, is_causal, None), atol=3e-2, rtol=3e-2)


def test_a_boolean_mask_per_sequence_and_a_float_bias_apply_to_the_real_block():
    q, k, v = _inputs(3, 4, 4, 70, 90)
    keys = torch.arange(90)[None, :] < torch.tensor([90, 75, 61])[:, None]
    mask = keys[:, None, None, :]
    got = sdpa._attend_with_matmuls(q.bfloat16(), k.bfloat16(), v.bfloat16(), 32**-0.5, False, mask)
    torch.testing.assert_close(got.float(), _reference(q, k, v, False, mask), atol=3e-2, rtol=3e-2)

    bias = torch.randn(1, 4, 70, 90, generator=torch.Generator().manual_seed(1))
    got = sdpa._attend_with_matmuls(q.bfloat16(), k.bfloat16(), v.bfloat16(), 32**-0.5, False, bias)
    torch.testing.assert_close(got.float(), _reference(q, k, v, False, bias), atol=3e-2, rtol=3e-2)


def test_the_matmuls_see_only_lengths_that_are_multiples_of_8(monkeypatch):
    shapes = []
    matmul = torch.matmul

    def recording(a, b):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return matmul(a, b)

    monkeypatch.setattr(torch, "matmul", recording)
    for length in range(64, 89):
        q, k, v = _inputs(2, 4, 4, length, length)
        sdpa._attend_with_matmuls(q.bfloat16(), k.bfloat16(), v.bfloat16(), 32**-0.5, True)
    assert len(shapes) == 2 * 25
    assert all(dim % 8 == 0 for a, b in shapes for dim in (*a[2:], *b[2:]) if dim != 32)
    assert len(set(shapes)) == 2 * 4  # lengths 64..88 run as 64, 72, 80 and 88
