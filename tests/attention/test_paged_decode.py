"""sdpa's CPU float32 decode path (attention/backends/paged_decode.py) against the naive oracle.

Keys gathered by block and scored in one batched matmul, values summed out of the cache by embedding_bag:
ragged key lengths on both sides of block boundaries, grouped-query heads up to the path's limit (beyond
it SDPA runs), decodes beside prompt chunks in one step, several layers of a step sharing the value rows
made once, and only the keys a sequence owns mattering. Windows and T5's bias on this path are covered by
test_sliding_window.py and test_relative_bias.py (their sdpa-fp32 cases decode here too).
"""

import pytest
import torch

from embedserv.attention.backends import paged_decode
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.backends.sdpa import SdpaBackend
from embedserv.attention.layer import Attention
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for
from tests.attention.test_paged_backends import Step

TOLERANCE = dict(atol=2e-5, rtol=2e-5)
# (tokens already cached, new tokens): key lengths at, just past and just before block boundaries (of 16
# and of 12), one key alone, and prompt chunks beside them.
DECODES = [(15, 1), (16, 1), (31, 1), (0, 1), (47, 1), (11, 1), (12, 1), (100, 1)]
MIXED = [(0, 9), (15, 1), (20, 13), (16, 1), (0, 1), (40, 1), (5, 30), (63, 1)]


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of the gathered decode path."""
    seen = []
    real = paged_decode.decode_gathered

    def spy(q, *args):
        seen.append(q.shape)
        return real(q, *args)

    monkeypatch.setattr("embedserv.attention.backends.sdpa.decode_gathered", spy)
    return seen


@pytest.mark.parametrize("mix", [DECODES, MIXED], ids=["decodes", "mixed"])
@pytest.mark.parametrize(
    "heads,kv_heads", [(4, 4), (8, 2), (8, 1), (9, 3), (16, 16)], ids=["mha", "gqa4", "mqa", "gqa3", "mha16"]
)
@pytest.mark.parametrize("block_size", [16, 12, 1])
def test_gathered_decodes_match_the_oracle(calls, mix, heads, kv_heads, block_size):
    step = Step(mix, heads, kv_heads, 32, torch.float32, "cpu", block_size)
    out = step.run(SdpaBackend())
    assert len(calls) == 1
    decodes = sum(1 for _, new in mix if new == 1)
    assert calls[0][0] == decodes
    torch.testing.assert_close(out, step.full_causal(), **TOLERANCE)
    torch.testing.assert_close(out, step.run(NaiveBackend()), **TOLERANCE)


@pytest.mark.parametrize("kv_heads", [4, 20], ids=["gqa", "mha"])
def test_more_heads_than_the_limit_go_to_sdpa(calls, kv_heads):
    heads = paged_decode.MAX_HEADS + 4
    step = Step(DECODES, heads, kv_heads, 16, torch.float32, "cpu")
    out = step.run(SdpaBackend())
    assert not calls
    torch.testing.assert_close(out, step.full_causal(), **TOLERANCE)


def test_bfloat16_decodes_do_not_take_the_path(calls):
    step = Step(DECODES, 8, 2, 32, torch.bfloat16, "cpu")
    out = step.run(SdpaBackend())
    assert not calls
    torch.testing.assert_close(out, step.full_causal(), atol=2e-2, rtol=2e-2)


def test_layers_of_a_step_share_one_metadata(calls):
    """Two layers of different query heads over one KV group: each gets value rows for its own heads (the
    step's memo is keyed by them), and a repeated shape reuses them."""
    step = Step(MIXED, 8, 2, 32, torch.float32, "cpu")
    backend = SdpaBackend()
    meta = backend.build_metadata(step.common)
    layers = [Attention(h, 32, num_kv_heads=2, layer_index=i) for i, h in enumerate((8, 4, 8))]
    caches = [step.cache.clone() for _ in layers]
    queries = [step.q, step.q.view(-1, 8, 32)[:, :4].reshape(-1, 4 * 32), step.q]
    with set_forward_context(forward_context_for(layers, backend, meta, kv_caches=caches)):
        outs = [layer(q, step.k, step.v) for layer, q in zip(layers, queries, strict=True)]
    assert len(calls) == 3 and len([k for k in meta.memo if k[0] == "decode-value-rows"]) == 2
    oracle = NaiveBackend()
    for layer, q, cache, out in zip(layers, queries, caches, outs, strict=True):
        alone = Attention(layer.num_heads, 32, num_kv_heads=2)
        with set_forward_context(forward_context_for([alone], oracle, oracle.build_metadata(step.common), [cache])):
            torch.testing.assert_close(out, alone(q, step.k, step.v), **TOLERANCE)


def test_unowned_slots_change_nothing():
    """Large values in blocks and slots no sequence owns (read, with probability 0) leave the output exact."""
    clean = Step(DECODES, 8, 2, 32, torch.float32, "cpu").run(SdpaBackend())
    noisy = Step(DECODES, 8, 2, 32, torch.float32, "cpu", unowned_fill=1e4).run(SdpaBackend())
    torch.testing.assert_close(noisy, clean, atol=0, rtol=0)


def test_value_rows_spell_out_the_tables():
    tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    rows = paged_decode.value_rows(tables, block_size=2, heads=4, kv_heads=2)
    # Sequence 0, head 3 (KV head 1): slots 6, 7, 2, 3 -> rows slot * 2 + 1.
    assert rows.shape == (8, 4)
    assert rows[3].tolist() == [13, 15, 5, 7]
    assert rows[4].tolist() == [0, 2, 8, 10]
