"""KV-cache groups: a layer that reads another layer's cache allocates nothing, and a second, fixed-size
group (as cross-attention will use) is sized at admission, never grows, is never prefix-cached, and is
freed with its request. Fake models made of Attention layers only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.layer import Attention, AttentionKind
from embedserv.scheduler.generation import GenerationScheduler
from embedserv.scheduler.kv_cache_manager import KvCacheManager, KvGroup
from embedserv.scheduler.request import Request, RequestStatus
from embedserv.steps import OutputKind
from embedserv.types import SamplingParams
from embedserv.worker.kv_cache import KvCache, allocate_kv_caches, kv_cache_groups, num_kv_blocks
from embedserv.worker.layer_routes import forward_context_for

HEADS, HEAD_SIZE, BLOCK = 2, 8, 4
CPU = torch.device("cpu")


class FakeModel(nn.Module):
    def __init__(self, layers: list[Attention]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


def _layers(shared: bool) -> FakeModel:
    return FakeModel(
        [
            Attention(HEADS, HEAD_SIZE, layer_index=0),
            Attention(HEADS, HEAD_SIZE, layer_index=1),
            Attention(HEADS, HEAD_SIZE, layer_index=2, kv_source_layer=1 if shared else None),
        ]
    )


def test_a_layer_reading_another_layers_cache_allocates_nothing():
    own, shared = _layers(shared=False), _layers(shared=True)
    (own_group,) = kv_cache_groups(own, BLOCK, torch.float32)
    (shared_group,) = kv_cache_groups(shared, BLOCK, torch.float32)
    assert own_group.layers == (0, 1, 2) and shared_group.layers == (0, 1)
    assert shared_group.bytes_per_block * 3 == own_group.bytes_per_block * 2
    memory = 3 * 2 * own_group.bytes_per_block  # exactly 6 blocks of three owning layers
    assert num_kv_blocks(memory, [own_group], CPU) == 6
    assert num_kv_blocks(memory, [shared_group], CPU) == 9, "the same memory holds more blocks"
    caches = allocate_kv_caches(shared, [shared_group], 9, NaiveBackend(), CPU)
    assert caches[2] is None and caches[0] is not None and caches[1] is not None
    context = forward_context_for(shared, NaiveBackend(), object(), kv_caches=caches)
    assert context.kv_caches[shared.layers[2].layer_index] is caches[1], "the shared layer reads its source's cache"
    assert context.kv_caches[shared.layers[1].layer_index] is caches[1]


def test_groups_come_from_the_layers_kind_and_group():
    model = FakeModel(
        [
            Attention(HEADS, HEAD_SIZE, layer_index=0, kind=AttentionKind.ENCODER),
            Attention(HEADS, HEAD_SIZE, layer_index=1, kv_group=0),
            Attention(HEADS, HEAD_SIZE, num_kv_heads=1, layer_index=2, kind=AttentionKind.CROSS, kv_group=1),
        ]
    )
    self_group, cross_group = kv_cache_groups(model, BLOCK, torch.float32)
    assert (self_group.layers, self_group.fixed, self_group.shapes) == ((1,), False, ((HEADS, HEAD_SIZE),))
    assert (cross_group.layers, cross_group.fixed, cross_group.shapes) == ((2,), True, ((1, HEAD_SIZE),))
    caches = allocate_kv_caches(model, [self_group, cross_group], 5, NaiveBackend(), CPU)
    assert caches[0] is None, "an encoder layer keeps no KV"
    assert caches[1].shape[1] == caches[2].shape[1] == 5, "every group has the same number of blocks"
    assert caches[2].shape[-2] == 1


def test_a_group_with_mixed_kinds_is_refused():
    model = FakeModel(
        [
            Attention(HEADS, HEAD_SIZE, layer_index=0),
            Attention(HEADS, HEAD_SIZE, layer_index=1, kind=AttentionKind.CROSS),
        ]
    )
    with pytest.raises(ValueError, match="mixes layer kinds"):
        kv_cache_groups(model, BLOCK, torch.float32)


def test_a_group_holds_layers_of_different_shapes():
    """Gemma 4's full layers have other KV heads and head sizes than its sliding ones; one table serves
    both: each layer's tensor has its own shape and the same block count."""
    model = FakeModel(
        [Attention(HEADS, HEAD_SIZE, layer_index=0), Attention(HEADS, 2 * HEAD_SIZE, num_kv_heads=1, layer_index=1)]
    )
    (group,) = kv_cache_groups(model, BLOCK, torch.float32)
    assert group.shapes == ((HEADS, HEAD_SIZE), (1, 2 * HEAD_SIZE))
    assert group.bytes_per_block == 2 * BLOCK * (HEADS * HEAD_SIZE + 2 * HEAD_SIZE) * 4
    caches = allocate_kv_caches(model, [group], 3, NaiveBackend(), CPU)
    assert caches[0].shape == (2, 3, BLOCK, HEADS, HEAD_SIZE)
    assert caches[1].shape == (2, 3, BLOCK, 1, 2 * HEAD_SIZE)


def _scheduler(num_blocks: int, caching: bool = True) -> GenerationScheduler:
    kv = KvCacheManager([KvGroup(BLOCK), KvGroup(BLOCK, fixed=True)], num_blocks, enable_prefix_caching=caching)
    return GenerationScheduler(kv, max_batch_tokens=64, max_num_seqs=8)


def _request(request_id: int, prompt: list[int], encoder: list[int], max_tokens: int = 4) -> Request:
    return Request(
        request_id, prompt, OutputKind.SAMPLE, SamplingParams(max_tokens=max_tokens), encoder_token_ids=encoder
    )


def _step(s: GenerationScheduler):
    batch = s.schedule()
    s.update(batch, {q.request_id: 7 for q in batch.sequences if q.produces_output})
    return batch


def test_a_fixed_group_is_sized_at_admission_never_grows_and_is_freed():
    s = _scheduler(num_blocks=16)
    request = _request(0, [1, 2, 3], encoder=list(range(10)))
    s.add(request)
    first = _step(s).sequences[0]
    self_table, cross_table = first.block_ids
    assert len(self_table) == 1 and len(cross_table) == 3, "cross: ceil(10 / 4) blocks at admission"
    for _ in range(3):
        decode = _step(s).sequences[0]
    assert len(decode.block_ids[0]) == 2, "the self table grows with the tokens"
    assert decode.block_ids[1] == cross_table, "the cross table never changes"
    cross = s.kv_cache.managers[1]
    assert cross.num_used_blocks == 3
    s.finish(0)
    assert request.block_ids == [] and s.kv_cache.num_used_blocks == 0
    s.kv_cache.check_invariants()


def test_a_fixed_group_is_never_prefix_cached_but_the_self_group_is():
    s = _scheduler(num_blocks=32)
    prompt = list(range(9))
    first = _request(0, prompt, encoder=[5] * 8)
    s.add(first)
    _step(s)
    s.finish(0)
    second = _request(1, prompt, encoder=[5] * 8)
    s.add(second)
    batch = _step(s)
    assert batch.sequences[0].start_position == 8, "two full self blocks came from the prefix cache"
    cross = s.kv_cache.managers[1]
    assert not any(cross.is_cached(block) for block in second.block_ids[1])
    assert all(cross.ref_count(block) == 1 for block in second.block_ids[1])
    s.kv_cache.check_invariants()


def test_preemption_frees_both_tables_and_a_request_that_can_never_fit_is_known_up_front():
    s = _scheduler(num_blocks=4, caching=False)
    big = _request(0, [1] * 4, encoder=[2] * 20)
    assert not s.can_ever_fit(big, 8), "20 encoder tokens need 5 cross blocks of the 4 there are"
    a, b = _request(1, [1, 1, 1], encoder=[2] * 8, max_tokens=8), _request(2, [1, 1, 1], encoder=[2] * 8, max_tokens=8)
    s.add(a)
    s.add(b)
    _step(s)
    assert s.kv_cache.managers[1].num_used_blocks == 4
    # Both grow by a token a step; at 9 tokens each needs a third self block and only 4 exist: the
    # latest admitted (b) is preempted and both of its tables are freed.
    for _ in range(10):
        _step(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and b.block_ids == []
    assert s.kv_cache.managers[1].num_used_blocks == 2 and len(a.block_ids[0]) == 3
    s.kv_cache.check_invariants()


def test_each_block_is_zeroed_on_its_first_use_only():
    """Backends read whole blocks and mask the slots past a sequence's end (and table padding, block 0); a
    NaN left in memory there would still reach the output (0 x NaN), so a block is zeroed the first time
    a step names it, and only then (memory is committed as blocks are used, not all at start-up)."""
    model = _layers(shared=True)
    (group,) = kv_cache_groups(model, BLOCK, torch.float32)
    tensors = allocate_kv_caches(model, [group], 8, NaiveBackend(), CPU)
    for tensor in tensors[:2]:
        tensor.fill_(float("nan"))
    cache = KvCache(tensors, [group], 8)
    assert all(torch.count_nonzero(t[:, 0]) == 0 for t in tensors[:2]), "block 0 pads every block table"
    fresh = cache.fresh_blocks([np.array([3, 5, 3])])
    assert fresh == [[3, 5]]
    cache.zero(fresh)
    for tensor in tensors[:2]:
        assert torch.count_nonzero(tensor[:, [3, 5]]) == 0
        assert tensor[:, [1, 2, 4, 6, 7]].isnan().all(), "blocks not used yet are left alone"
        tensor[:, 3] = 1.0  # written by a step
    assert cache.fresh_blocks([np.array([3, 0, 6])]) == [[6]], "a block is zeroed once"


def test_a_block_size_the_backend_cannot_read_stops_start_up():
    from embedserv.attention.backends.base import PagedBackendBase
    from embedserv.config import ModelConfig
    from embedserv.errors import ConfigError
    from embedserv.models.loading.spec_reader import _kv_block_size
    from embedserv.models.loading.tasks import TaskSpec
    from embedserv.types import Task

    class PagesOf256(PagedBackendBase):  # as flash-attn's paged kernel reads them
        name = "pages-of-256"
        default_block_size = 256
        block_size_multiple = 256

    generates = TaskSpec(tasks=(Task.GENERATE,))
    config = ModelConfig(path="m", served_name="m", kv_block_size=16)
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="multiple of 256"):
        _kv_block_size(config, PagesOf256(), generates, cpu)
    assert _kv_block_size(ModelConfig(path="m", served_name="m"), PagesOf256(), generates, cpu) == 256
    assert _kv_block_size(config, NaiveBackend(), generates, cpu) == 16


def test_the_encoder_runs_in_the_first_step_after_each_admission_only():
    s = _scheduler(num_blocks=4, caching=False)
    a, b = _request(1, [1, 1, 1], encoder=[2] * 8, max_tokens=8), _request(2, [1, 1, 1], encoder=[3] * 8, max_tokens=8)
    s.add(a)
    s.add(b)
    first = _step(s)
    assert [q.encoder_token_ids for q in first.sequences] == [(2,) * 8, (3,) * 8]
    assert all(q.encoder_len == 8 for q in first.sequences)
    runs_of_b = 1
    for _ in range(40):
        batch = _step(s)
        for done in [
            r for r in (a, b) if len(r.output_token_ids) >= r.max_tokens and r.status is RequestStatus.RUNNING
        ]:
            s.finish(done.request_id)
        for q in batch.sequences:
            assert q.encoder_len == 8, "cross attention reads the whole encoder input every step"
            if q.request_id == 1:
                assert q.encoder_token_ids == (), "a's cross KV was written once and is only read after"
            elif q.encoder_token_ids:
                assert q.start_position == 0, "b's encoder runs again only when b is recomputed"
                runs_of_b += 1
        if s.num_running == 0 and s.num_waiting == 0:
            break
    assert a.status is RequestStatus.FINISHED and b.status is RequestStatus.FINISHED
    assert s.num_preemptions >= 1 and runs_of_b == 1 + b.num_preemptions


def test_different_encoder_inputs_share_no_decoder_block():
    """The decoder's keys depend on the encoder input: the same decoder prompt after another encoder input
    takes nothing from the prefix cache; after the same one it does."""
    s = _scheduler(num_blocks=32)
    prompt = list(range(9))
    s.add(_request(0, prompt, encoder=[5] * 8))
    _step(s)
    s.finish(0)
    other = _request(1, prompt, encoder=[6] * 8)
    s.add(other)
    assert _step(s).sequences[0].start_position == 0, "another encoder input: no cached decoder block"
    s.finish(1)
    same = _request(2, prompt, encoder=[5] * 8)
    s.add(same)
    assert _step(s).sequences[0].start_position == 8
    s.kv_cache.check_invariants()


def test_a_cancelled_request_frees_both_tables_waiting_or_running():
    s = _scheduler(num_blocks=16, caching=False)
    running, waiting = _request(0, [1, 2], encoder=[3] * 9), _request(1, [1, 2], encoder=[3] * 9)
    s.add(running)
    _step(s)
    s.add(waiting)
    assert s.kv_cache.managers[1].num_used_blocks == 3
    s.finish(0)
    s.finish(1)
    assert s.kv_cache.num_used_blocks == 0 and running.block_ids == [] and waiting.block_ids == []
    s.kv_cache.check_invariants()


def test_the_input_builder_writes_only_this_steps_encoder_tokens_to_the_cross_tables():
    from embedserv.steps import ScheduledSequence, StepBatch
    from embedserv.worker.input_builder import InputBuilder

    builder = InputBuilder(CPU, 0, True, BLOCK, fixed_groups=(False, True), is_encoder_decoder=True)
    greedy = SamplingParams(max_tokens=1)
    decoding = ScheduledSequence(0, (9,), OutputKind.SAMPLE, 5, ((1, 2), (3, 4)), True, greedy, encoder_len=6)
    fresh = ScheduledSequence(
        1,
        (9, 8),
        OutputKind.SAMPLE,
        0,
        ((5,), (6, 7)),
        True,
        greedy,
        encoder_token_ids=(11, 12, 13, 14, 15),
        encoder_len=5,
    )
    inputs = builder.build(StepBatch((decoding, fresh)))
    self_meta, cross = inputs.attention
    # Packed longest first: the fresh request (2 decoder tokens) before the decoding one.
    assert inputs.encoder.input_ids.tolist() == [11, 12, 13, 14, 15]
    assert inputs.encoder.positions.tolist() == [0, 1, 2, 3, 4]
    assert cross.cross and not cross.is_causal and self_meta.is_causal and not self_meta.cross
    assert cross.seq_lens_k_cpu.tolist() == [5, 6] and cross.seq_lens_q_cpu.tolist() == [2, 1]
    # Encoder positions 0..4 of the fresh request in its cross table (6, 7) of 4-token blocks.
    assert cross.slot_mapping.tolist() == [24, 25, 26, 27, 28]
    assert cross.block_tables.tolist() == [[6, 7], [3, 4]]
    assert self_meta.slot_mapping.tolist() == [20, 21, 9]
    assert self_meta.seq_lens_k_cpu.tolist() == [2, 6]
    assert inputs.encoder.attention.seq_lens_q_cpu.tolist() == [5]
