"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL as last-token embedders on tiny random checkpoints, against transformers: the
checkpoint's inner Qwen2VLModel / Qwen2_5_VLModel / Qwen3VLModel (DeepStack, interleaved M-RoPE) given input_ids,
pixel_values and image_grid_thw (so it rotates by M-RoPE), the last token's final state, L2-normalized
(tests/helpers/qwen_vl_models.reference_embedding). Images of several sizes and aspect ratios alone and with text,
texts alone, all in one packed pass with padding rows, texts-only passes, batch invariance; inputs of two and
three images interleaved with texts (reference_interleaved: the processor's chat template) packed with those; the
vision towers (Qwen2.5-VL's windows, Qwen3-VL's DeepStack features included) against transformers' `visual`; the
window order against transformers' get_vision_window_index; Qwen3-VL's position-table taps against transformers'
get_vision_interpolation_indices_and_weights; and the hub's older checkpoint layout (GME's, DSE's) loading the
same parameters."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.metadata import build_common_metadata
from embedserv.forward_context import set_forward_context
from embedserv.models.mrope import packed_mrope_positions
from embedserv.models.vision_windows import VisionWindows
from embedserv.worker.image_inputs import frame_lengths, image_rows
from embedserv.worker.layer_routes import forward_context_for
from tests.helpers.compare import assert_cosine_at_least
from tests.helpers.qwen_vl_models import (
    KINDS,
    build_tiny_qwen_vl,
    load_reference,
    reference_embedding,
    reference_interleaved,
)
from tests.helpers.vision_language_models import COLQWEN2_SIZES, hub_layout_copy, page_image, same_parameters

# The ColQwen2 pages' sizes and a larger one (10 x 12 patches: Qwen2.5-VL windows cut short on both sides).
SIZES = (*COLQWEN2_SIZES, (140, 168))
TEXTS = ["what is a socket", "how to parse json files", "x"]


@pytest.fixture(scope="module", params=KINDS)
def model_dir(request, tmp_path_factory):
    return build_tiny_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(model_dir):
    return load_reference(model_dir)


def _load(model_dir):
    from embedserv.models import registry
    from embedserv.models.loading.checkpoint import checkpoint_files
    from embedserv.models.loading.hf_config import read_hf_config
    from embedserv.models.loading.weights import build_model

    hf_config = read_hf_config(model_dir)
    family = registry.lookup(hf_config.model_type)
    return build_model(family, hf_config, checkpoint_files(model_dir), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def ours(model_dir):
    return _load(model_dir)


@pytest.fixture(scope="module")
def cases(reference):
    """Every test's inputs with transformers' vectors, computed once per model: images (two with text), texts."""
    return _items(reference, _images(), TEXTS, image_texts=["", "what does it show", "", "a chart of sales"])


def _images():
    from PIL import Image

    return [Image.open(io.BytesIO(page_image(h, w, seed=i))) for i, (h, w) in enumerate(SIZES)]


def _items(reference, images, texts, image_texts=()):
    """(expected vector, (ids, pixel rows or None, grids)) per input: each image alone (with the text of
    `image_texts` at its index, if any), then each text alone."""
    out = []
    for index, image in enumerate(images):
        text = image_texts[index] if index < len(image_texts) else ""
        out.append(_item(*reference_embedding(reference, text, image)))
    for text in texts:
        out.append(_item(*reference_embedding(reference, text)))
    return out


def _item(expected, batch) -> tuple:
    """(expected vector, (ids, pixel rows or None, one grid per image)) of a reference input."""
    grids = tuple(tuple(grid) for grid in batch["image_grid_thw"].tolist()) if "pixel_values" in batch else ()
    return expected, (batch["input_ids"][0], batch.get("pixel_values"), grids)


def _vision_metadata(backend, model, images):
    """`images`: (pixel rows, grids) per sequence with images."""
    if not images:
        return None, None
    grids = [grid for _, gs in images for grid in gs]
    counts = [count for rows, gs in images for count in image_rows(len(rows), gs)]
    vision = backend.build_metadata(build_common_metadata(frame_lengths(counts, grids), False))
    windows = None
    if model.vision_windows is not None:
        windows = backend.build_metadata(build_common_metadata(model.vision_windows.lengths(grids), False))
    return vision, windows


def _embed(model, items, pad_tokens: int = 0, pad_rows: int = 0) -> list[torch.Tensor]:
    """Our normalized last-token vectors from one packed pass under the naive backend, padding rows after the
    real ones as the input builder pads them on CPU."""
    lens = [len(ids) for ids, _, _ in items]
    ids = torch.cat([ids for ids, _, _ in items] + [torch.zeros(pad_tokens, dtype=torch.long)])
    packed = packed_mrope_positions([(i.tolist(), g, 0) for i, _, g in items], model.mrope)
    positions = torch.nn.functional.pad(torch.from_numpy(packed), (0, pad_tokens))
    images = [(rows, grids) for _, rows, grids in items if rows is not None]
    backend, extra = NaiveBackend(), {}
    if images:
        rows = torch.cat([r for r, _ in images] + [torch.zeros(pad_rows, images[0][0].shape[1])])
        extra = {"pixel_values": rows, "image_grids": tuple(g for _, gs in images for g in gs)}
    vision, windows = _vision_metadata(backend, model, images)
    text = backend.build_metadata(build_common_metadata(np.array(lens), True))
    context = forward_context_for(model, backend, text, encoder_metadata=vision, window_metadata=windows)
    with torch.inference_mode(), set_forward_context(context):
        hidden = model(ids, positions, **extra)
    last = torch.tensor(np.cumsum(lens) - 1)
    return list(torch.nn.functional.normalize(hidden[last], dim=-1))


def _assert_close(got, items) -> None:
    for vector, (expected, _) in zip(got, items, strict=True):
        assert_cosine_at_least(vector.numpy()[None], expected.numpy()[None], 0.9999)
        np.testing.assert_allclose(vector.numpy(), expected.numpy(), rtol=0, atol=2e-4)


def test_images_texts_and_images_with_text_in_one_pass_equal_transformers(ours, cases):
    items = sorted(cases, key=lambda item: -len(item[1][0]))
    _assert_close(_embed(ours, [i for _, i in items], pad_tokens=5, pad_rows=7), items)


def test_texts_alone_equal_transformers(ours, cases):
    items = cases[len(SIZES) :]
    _assert_close(_embed(ours, [i for _, i in items], pad_tokens=3), items)


def test_an_input_alone_equals_it_packed_with_others(ours, cases):
    items = [i for _, i in cases]
    packed = _embed(ours, items)
    # Alone: a wide image, one with text, a tall one, the largest, a text.
    for index in (0, 1, 4, len(SIZES) - 1, len(SIZES)):
        item = items[index]
        torch.testing.assert_close(_embed(ours, [item])[0], packed[index], rtol=0, atol=2e-5)


def test_vision_tower_equals_transformers_visual(ours, reference, cases):
    images = [(rows, grids) for _, (_, rows, grids) in cases[: len(SIZES)]]
    backend = NaiveBackend()
    vision, windows = _vision_metadata(backend, ours, images)
    text = backend.build_metadata(build_common_metadata(np.array([1]), True))
    context = forward_context_for(ours, backend, text, encoder_metadata=vision, window_metadata=windows)
    rows, grids = torch.cat([r for r, _ in images]), tuple(g for _, gs in images for g in gs)
    with torch.inference_mode(), set_forward_context(context):
        got = ours.visual(rows, grids)
    with torch.no_grad():
        expected = reference[0].model.visual(rows, grid_thw=torch.tensor(grids), return_dict=True)
    if isinstance(got, tuple):
        # Qwen3-VL: the merged tokens and DeepStack's features.
        got, deepstack = got
        assert len(deepstack) == len(expected.deepstack_features) > 0
        for ours_feature, feature in zip(deepstack, expected.deepstack_features, strict=True):
            torch.testing.assert_close(ours_feature, feature, rtol=0, atol=1e-4)
    torch.testing.assert_close(got, expected.pooler_output, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def interleaved(reference):
    """Texts and images interleaved, one input each, as the processor's chat template frames them, with transformers'
    vectors: two images (wide, tall), and three (large, portrait, tall) with text between and after."""
    images = _images()
    inputs = (["compare", images[0], "with", images[3]], [images[5], "a chart", images[1], images[4], "and a photo"])
    return [_item(*reference_interleaved(reference, parts)) for parts in inputs]


def test_interleaved_inputs_packed_with_single_images_and_texts_equal_transformers(ours, cases, interleaved):
    """Several images in one sequence: their placeholders take their features in order, positions run on from
    each image; beside an image with text, an image alone and a text; each alone equals it packed."""
    assert [len(grids) for _, (_, _, grids) in interleaved] == [2, 3]
    items = [interleaved[0], cases[1], interleaved[1], cases[2], cases[-1]]
    packed = _embed(ours, [i for _, i in items], pad_tokens=5, pad_rows=7)
    _assert_close(packed, items)
    for index in (0, 2):
        torch.testing.assert_close(_embed(ours, [items[index][1]])[0], packed[index], rtol=0, atol=2e-5)


def test_qwen2_5_windows_equal_transformers_window_index():
    from transformers.vision_utils import get_vision_window_index

    grids = ((1, 4, 6), (1, 10, 12), (2, 6, 4), (1, 8, 8))
    for window_size in (56, 112):
        windows = VisionWindows(window_size, 14, 2)
        index, cu = get_vision_window_index(torch.tensor(grids), 2, window_size, 14)
        np.testing.assert_array_equal(windows.order(grids), index.numpy())
        np.testing.assert_array_equal(np.cumsum(windows.lengths(grids)), cu.numpy()[1:])


def test_qwen3_vl_position_table_taps_equal_transformers():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    from embedserv.models.families.qwen3_vision import position_taps

    grids = ((1, 4, 6), (1, 10, 12), (1, 2, 2), (1, 8, 4))
    for side in (4, 48):
        indices, weights = get_vision_interpolation_indices_and_weights(
            torch.tensor(grids), side, mode="bilinear", align_corners=True, spatial_merge_size=2
        )
        got_indices, got_weights = position_taps(grids, 2, side, len(indices) + 3)
        np.testing.assert_array_equal(got_indices[: len(indices)], indices.numpy())
        np.testing.assert_allclose(got_weights[: len(indices)], weights.numpy(), rtol=0, atol=1e-6)
        assert not got_weights[len(indices) :].any()


def test_the_hubs_checkpoint_layout_loads_the_same(model_dir, ours, tmp_path):
    """Checkpoints saved before transformers 5 (GME's, DSE's) keep the language model under `model.` and the
    tower under `visual.`."""

    def rename(name: str) -> str:
        return name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)

    copy = hub_layout_copy(model_dir, tmp_path / "hub", rename, {})
    assert same_parameters(_load(copy), ours)


def test_a_pass_with_images_asks_the_device_nothing(ours, cases):
    """No op whose output size depends on the data (nonzero, boolean indexing): on a GPU each would wait for the
    device before the host could queue the next kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        _embed(ours, [i for _, i in cases[:2]])
    assert "masked_scatter.default" in ops.names  # the images went in
    assert not {name for name in ops.names if name.startswith(("nonzero", "masked_select", "argwhere"))}
