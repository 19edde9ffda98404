"""M-RoPE positions (models/mrope.py) against transformers' Qwen2VLModel.get_rope_index: text-only sequences,
images of several sizes and aspect ratios anywhere in a sequence, several images in one, a padded batch (each
sequence from its own 0), and the packed form the input builder uses (with an interleaved input's several images
in one sequence)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedserv.models.mrope import MRopeSpec, image_token_count, mrope_positions, packed_mrope_positions

IMAGE = 99
MERGE = 2
# (t, h, w) in patches: square, wide, tall, small, large, and two frames.
GRIDS = ((1, 4, 4), (1, 4, 10), (1, 12, 6), (1, 2, 2), (1, 16, 22), (2, 6, 4))


def _reference(batch: list[list[int]], grids: list[tuple[int, int, int]]) -> list[np.ndarray]:
    """transformers' positions per sequence, the batch right-padded with an attention mask."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    model = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=MERGE)),
        get_vision_position_ids=partial(Qwen2VLModel.get_vision_position_ids, None),
    )
    width = max(len(ids) for ids in batch)
    ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in batch])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in batch])
    positions, _ = Qwen2VLModel.get_rope_index(
        model,
        ids,
        mm_token_type_ids=(ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids) if grids else None,
        attention_mask=mask,
    )
    return [positions[:, i, : len(seq)].numpy() for i, seq in enumerate(batch)]


def _sequence(*parts) -> tuple[list[int], list[tuple[int, int, int]]]:
    """ints: that many text tokens; tuples: an image of that grid."""
    ids: list[int] = []
    grids = []
    for part in parts:
        if isinstance(part, int):
            ids += [5 + (i % 7) for i in range(part)]
        else:
            ids += [IMAGE] * image_token_count(part, MERGE)
            grids.append(part)
    return ids, grids


@pytest.mark.parametrize("grid", GRIDS)
def test_one_image_between_texts_equals_transformers(grid):
    ids, grids = _sequence(6, grid, 9)
    got = mrope_positions(ids, grids, MERGE, IMAGE)
    np.testing.assert_array_equal(got, _reference([ids], grids)[0])
    # The text after the image continues from the image's start + max(h, w) / merge in all three: one past its
    # largest position (for these grids: no more frames than rows or columns).
    image_end = 6 + image_token_count(grid, MERGE)
    assert got[:, image_end].tolist() == [6 + max(grid[1:]) // MERGE] * 3 == [int(got[:, 6:image_end].max()) + 1] * 3


@pytest.mark.parametrize(
    "parts",
    [
        ((1, 4, 10), 3),
        (5, (1, 12, 6)),
        (4, (1, 4, 4), 2, (1, 4, 10), 7, (1, 12, 6), 1),
        (3, (1, 16, 22), 1, (1, 2, 2)),
    ],
    ids=["image-first", "image-last", "three-images", "large-then-small"],
)
def test_images_anywhere_and_several_equal_transformers(parts):
    ids, grids = _sequence(*parts)
    np.testing.assert_array_equal(mrope_positions(ids, grids, MERGE, IMAGE), _reference([ids], grids)[0])


def test_text_only_is_plain_positions_in_all_three():
    ids, _ = _sequence(17)
    got = mrope_positions(ids, [], MERGE, IMAGE)
    np.testing.assert_array_equal(got, np.tile(np.arange(17), (3, 1)))
    # transformers gives a text-only batch no 3-D positions (its text model counts 0.. in all three); with the
    # text typed as text, get_rope_index agrees.
    np.testing.assert_array_equal(got, _reference([ids], [])[0])


def test_each_sequence_of_a_batch_counts_from_its_own_zero():
    sequences = [_sequence(3, (1, 4, 10), 8), _sequence(11), _sequence(2, (1, 12, 6), 1, (1, 2, 2), 4)]
    grids = [g for _, seq_grids in sequences for g in seq_grids]
    expected = _reference([ids for ids, _ in sequences], grids)
    packed = packed_mrope_positions([(ids, g, 0) for ids, g in sequences], MRopeSpec(IMAGE, MERGE))
    np.testing.assert_array_equal(packed, np.concatenate(expected, axis=1))


def test_touching_images_each_start_anew():
    """transformers fails on two images with no token between (one run, one grid); here each image takes its
    own tokens, as if a zero-length text sat between them."""
    first, second = (1, 4, 10), (1, 6, 4)
    ids, grids = _sequence(2, first, second, 3)
    got = mrope_positions(ids, grids, MERGE, IMAGE)
    at = 2 + image_token_count(first, MERGE)
    np.testing.assert_array_equal(got[:, :at], mrope_positions(*_sequence(2, first), MERGE, IMAGE))
    # The second image starts one past the first's largest position (2 + 5), in all three.
    np.testing.assert_array_equal(got[:, at], [7, 7, 7])
    np.testing.assert_array_equal(got[:, -3:], np.tile(np.arange(10, 13), (3, 1)))


def test_text_continues_from_a_start_position():
    ids, _ = _sequence(4)
    got = packed_mrope_positions([(ids, (), 9)], MRopeSpec(IMAGE, MERGE))
    np.testing.assert_array_equal(got, np.tile(np.arange(9, 13), (3, 1)))


def test_refusals():
    ids, grids = _sequence(2, (1, 4, 4), 2)
    with pytest.raises(ValueError, match="4 image tokens in the sequence but its 1 image grids give 6"):
        mrope_positions(ids, [(1, 4, 6)], MERGE, IMAGE)
    with pytest.raises(ValueError, match="runs whole in one step"):
        packed_mrope_positions([(ids, grids, 3)], MRopeSpec(IMAGE, MERGE))


def test_the_input_builder_packs_3d_positions_longest_first_with_padding_rows():
    """A step of a text, and two pages: positions [3, padded], each sequence as get_rope_index gives it alone, in
    the packed (longest-first) order; padding rows (CPU) get the offset; other rows of the step are unchanged."""
    from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
    from embedserv.worker.input_builder import InputBuilder

    sequences = [_sequence(5), _sequence(2, (1, 4, 10), 3), _sequence(1, (1, 12, 6), 2)]
    batch = StepBatch(
        tuple(
            ScheduledSequence(
                request_id=i,
                token_ids=tuple(ids),
                output=OutputKind.POOL,
                pixels=np.zeros((int(np.prod(grids[0])), 4), np.float32) if grids else None,
                image_grids=tuple(map(tuple, grids)),
            )
            for i, (ids, grids) in enumerate(sequences)
        )
    )
    spec = MRopeSpec(IMAGE, MERGE)
    inputs = InputBuilder(torch.device("cpu"), 0, True, pad_rows=True, mrope=spec).build(batch)
    plain = InputBuilder(torch.device("cpu"), 0, True, pad_rows=True).build(batch)
    order = [2, 1, 0]
    expected = np.concatenate([_reference([sequences[i][0]], sequences[i][1])[0] for i in order], axis=1)
    positions = inputs.tokens.positions
    total = expected.shape[1]
    assert positions.shape == (3, len(plain.tokens.positions)) and positions.shape[1] > total
    np.testing.assert_array_equal(positions[:, :total].numpy(), expected)
    assert not positions[:, total:].any()
    assert torch.equal(inputs.tokens.input_ids, plain.tokens.input_ids)
    assert inputs.images.grids == ((1, 12, 6), (1, 4, 10))


def test_a_sequence_with_several_images_gives_each_its_own_vision_sequences():
    """An interleaved input's images in one sequence: their grids reach the tower flat in packed order, its rows
    split by each grid's t * h * w into one vision sequence per frame; its positions as get_rope_index's."""
    from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
    from embedserv.worker.input_builder import InputBuilder

    sequences = [_sequence(2, (1, 4, 10), 3), _sequence(3, (1, 4, 4), 2, (2, 6, 4), 1, (1, 2, 2), 1)]
    batch = StepBatch(
        tuple(
            ScheduledSequence(
                request_id=i,
                token_ids=tuple(ids),
                output=OutputKind.POOL,
                pixels=np.zeros((sum(int(np.prod(g)) for g in grids), 4), np.float32),
                image_grids=tuple(grids),
            )
            for i, (ids, grids) in enumerate(sequences)
        )
    )
    inputs = InputBuilder(torch.device("cpu"), 0, True, mrope=MRopeSpec(IMAGE, MERGE)).build(batch)
    assert inputs.images.grids == ((1, 4, 4), (2, 6, 4), (1, 2, 2), (1, 4, 10))
    assert inputs.images.attention.cu_seqlens_q.tolist() == [0, 16, 40, 64, 68, 108]
    expected = np.concatenate([_reference([ids], grids)[0] for ids, grids in sequences[::-1]], axis=1)
    np.testing.assert_array_equal(inputs.tokens.positions.numpy(), expected)
    with pytest.raises(ValueError, match="holds several images whose grids"):
        InputBuilder(torch.device("cpu"), 0, True, mrope=MRopeSpec(IMAGE, MERGE)).build(
            StepBatch((replace(batch.sequences[1], pixels=np.zeros((5, 4), np.float32)),))
        )
