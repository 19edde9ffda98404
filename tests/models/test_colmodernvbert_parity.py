"""ColModernVBERT against transformers' ColModernVBertForRetrieval and ColModernVBertProcessor on a tiny random
model: our rules frame pages (tiles, row/col tokens, global image) and queries into the processor's ids and our
image preprocessing makes its pixels, for pages of several sizes and aspect ratios, split into tiles or not; page
and query vectors from packed passes (text-only and mixed, with padding rows) equal transformers' (cosine >=
0.9999 per vector, as many vectors); an input alone equals it packed with others; MaxSim equals the processor's
score_retrieval."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from embedserv.engine.inputs.images import patch_rows, prepare_image
from embedserv.engine.tasks.multi_vector import maxsim_scores
from embedserv.types import EmbedOutput, EmbedParams
from tests.helpers.colmodernvbert_models import PATCH, build_tiny_colmodernvbert, unsplit_copy
from tests.helpers.compare import assert_cosine_at_least
from tests.helpers.vision_language_models import load_ours, packed_vectors, page_image

QUERIES = ["what is a socket", "how to parse json files", "x"]
# (height, width, format): tall (2x1 tiles), wide (1x2), square (2x2), small (upscaled), odd sizes, very wide.
PAGES = ((100, 30, "PNG"), (30, 100, "JPEG"), (64, 64, "PNG"), (20, 20, "PNG"), (97, 61, "JPEG"), (40, 250, "PNG"))
PARAMS = EmbedParams(outputs=(EmbedOutput.MULTI_VECTOR,))


def _pages() -> list[bytes]:
    return [page_image(h, w, seed=i, fmt=fmt) for i, (h, w, fmt) in enumerate(PAGES)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_colmodernvbert(tmp_path_factory.mktemp("colmodernvbert"))


@pytest.fixture(scope="module", params=["split", "unsplit"])
def setup(request, model_dir, tmp_path_factory):
    """(served model: our rules and preprocessing, our model, transformers' model and processor) for pages split
    into tiles (the default) or not (do_image_splitting false: one frame a page)."""
    from transformers import ColModernVBertForRetrieval, ColModernVBertProcessor

    from embedserv.config import ModelConfig
    from embedserv.engine.served_model import read_served_model

    path = model_dir if request.param == "split" else unsplit_copy(model_dir, tmp_path_factory.mktemp("u") / "m")
    served = read_served_model(ModelConfig(path=str(path), served_name="colmodernvbert", dtype="float32"))
    reference = ColModernVBertForRetrieval.from_pretrained(str(path)).eval()
    return served, load_ours(path), reference, ColModernVBertProcessor.from_pretrained(str(path))


def _processed(processor, pages: list[bytes], queries: list[str]) -> list[dict]:
    from PIL import Image

    batches = [processor.process_images([Image.open(io.BytesIO(data))]) for data in pages]
    return batches + [processor.process_queries([query]) for query in queries]


def _expected(model, batches: list[dict]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**batch).embeddings[0] for batch in batches]


def _items(served, pages: list[bytes], queries: list[str]) -> list[tuple]:
    """Per input (ids, patch rows or None, grid) as the engine makes them: pages, then queries."""
    rules, vision = served.token_rules, served.vision
    out = []
    for index, data in enumerate(pages):
        rows, grid = prepare_image(data, index, vision.processing, vision.limits)
        page = rules.encode_image(rows, grid, PARAMS)
        out.append((torch.tensor(page.ids), torch.from_numpy(page.pixels), page.image_grids[0]))
    for query in rules.encode(served.tokenizer, queries, PARAMS):
        out.append((torch.tensor(query.ids), None, ()))
    return out


def test_colmodernvbert_attends_both_ways(setup):
    assert not setup[1][2]


def test_page_and_query_inputs_equal_the_processors(setup):
    served, _, _, processor = setup
    batches = _processed(processor, _pages(), QUERIES)
    tiled = 0
    for item, batch in zip(_items(served, _pages(), QUERIES), batches, strict=True):
        ids, rows, grid = item
        assert ids.tolist() == batch["input_ids"][0].tolist()
        if rows is not None:
            frames = batch["pixel_values"][0].numpy()
            assert grid == (len(frames), 6, 6)
            tiled += len(frames) > 1
            expected = np.concatenate([patch_rows(frame, PATCH) for frame in frames])
            np.testing.assert_array_equal(rows.numpy(), expected)
    assert tiled == (len(PAGES) if served.vision.processing.split_tiles else 0)


@pytest.mark.parametrize("fmt", ["as_given", "JPEG"])
def test_pages_and_queries_in_one_pass_equal_transformers(setup, fmt):
    served, ours, reference, processor = setup
    pages = _pages() if fmt == "as_given" else [page_image(h, w, seed=i, fmt=fmt) for i, (h, w, _) in enumerate(PAGES)]
    items = _items(served, pages, QUERIES)
    expected = _expected(reference, _processed(processor, pages, QUERIES))
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    got = packed_vectors(*ours, [items[i] for i in order], pad_tokens=3, pad_rows=5)
    for position, index in enumerate(order):
        assert len(got[position]) == len(expected[index])
        assert_cosine_at_least(got[position].numpy(), expected[index].numpy(), 0.9999)


def test_queries_alone_in_one_pass_equal_transformers(setup):
    served, ours, reference, processor = setup
    items = _items(served, [], QUERIES)
    expected = _expected(reference, _processed(processor, [], QUERIES))
    for got, want in zip(packed_vectors(*ours, items, pad_tokens=2), expected, strict=True):
        assert len(got) == len(want)
        assert_cosine_at_least(got.numpy(), want.numpy(), 0.9999)


def test_an_input_alone_equals_it_packed_with_others(setup):
    served, ours, _, _ = setup
    items = _items(served, _pages(), QUERIES)
    packed = packed_vectors(*ours, items, pad_rows=4)
    for index, item in enumerate(items):
        torch.testing.assert_close(packed_vectors(*ours, [item])[0], packed[index], rtol=0, atol=2e-5)


def test_maxsim_equals_the_processors_score_retrieval(setup):
    served, ours, reference, processor = setup
    got = packed_vectors(*ours, _items(served, _pages(), QUERIES))
    expected = _expected(reference, _processed(processor, _pages(), QUERIES))
    pages = len(PAGES)
    # One page per call: in a batch score_retrieval pads pages with zero vectors (test_colqwen2_parity.py).
    scores = torch.cat([processor.score_retrieval(expected[pages:], [page]) for page in expected[:pages]], dim=1)
    for q in range(len(QUERIES)):
        ours_scores = maxsim_scores(got[pages + q].numpy(), [g.numpy() for g in got[:pages]], mean=False)
        np.testing.assert_allclose(ours_scores, scores[q].numpy(), rtol=1e-4)
