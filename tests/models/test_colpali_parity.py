"""ColPali against transformers' ColPaliForRetrieval on a tiny random model: page-image and query vectors
(cosine >= 0.9999 per vector, as many vectors) from a packed pass with padding rows, MaxSim against the
processor's score_retrieval, batch invariance, and the attention transformers runs (bidirectional)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from embedserv.engine.inputs.images import patch_rows
from embedserv.engine.tasks.multi_vector import maxsim_scores
from tests.helpers.compare import assert_cosine_at_least
from tests.helpers.vision_language_models import (
    build_tiny_colpali,
    hub_layout_copy,
    load_ours,
    packed_vectors,
    page_image,
    same_parameters,
)

QUERIES = ["what is a socket", "how to parse json files", "x"]
# Any size: the processor resizes every page to the tower's 28x28.
SIZES = ((40, 30), (28, 28), (90, 64))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_colpali(tmp_path_factory.mktemp("colpali"))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import ColPaliForRetrieval, ColPaliProcessor

    return ColPaliForRetrieval.from_pretrained(str(model_dir)).eval(), ColPaliProcessor.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def ours(model_dir):
    return load_ours(model_dir)


def _inputs(processor, queries, fmt: str = "PNG"):
    """Per input (ids, patch rows or None, ()), each processed alone; pages first, then queries."""
    from PIL import Image

    out = []
    for i, (h, w) in enumerate(SIZES):
        batch = processor.process_images([Image.open(io.BytesIO(page_image(h, w, seed=i, fmt=fmt)))])
        rows = torch.from_numpy(patch_rows(batch["pixel_values"][0].numpy(), 14))
        out.append((batch["input_ids"][0], rows, ()))
    for query in queries:
        out.append((processor.process_queries([query])["input_ids"][0], None, ()))
    return out


def _expected(reference, processor, queries, fmt: str = "PNG") -> list[torch.Tensor]:
    from PIL import Image

    model = reference[0]
    batches = [
        processor.process_images([Image.open(io.BytesIO(page_image(h, w, seed=i, fmt=fmt)))])
        for i, (h, w) in enumerate(SIZES)
    ]
    batches += [processor.process_queries([q]) for q in queries]
    with torch.no_grad():
        return [model(**{k: v for k, v in b.items() if k != "labels"}).embeddings[0] for b in batches]


def test_colpali_attends_both_ways_as_transformers_runs_it(ours):
    assert not ours[2]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_page_images_and_queries_in_one_pass_equal_transformers(ours, reference, fmt):
    processor = reference[1]
    items = _inputs(processor, QUERIES, fmt)
    expected = _expected(reference, processor, QUERIES, fmt)
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    got = packed_vectors(*ours, [items[i] for i in order], pad_tokens=3, pad_rows=5)
    for position, index in enumerate(order):
        assert len(got[position]) == len(expected[index])
        assert_cosine_at_least(got[position].numpy(), expected[index].numpy(), 0.9999)


def test_an_input_alone_equals_it_packed_with_others(ours, reference):
    items = _inputs(reference[1], QUERIES)
    packed = packed_vectors(*ours, items)
    for index, item in enumerate(items):
        torch.testing.assert_close(packed_vectors(*ours, [item])[0], packed[index], rtol=0, atol=2e-5)


def test_maxsim_equals_the_processors_score_retrieval(ours, reference):
    processor = reference[1]
    got = packed_vectors(*ours, _inputs(processor, QUERIES))
    expected = _expected(reference, processor, QUERIES)
    pages = len(SIZES)
    # One page per call (every page has as many vectors here, but see test_colqwen2_parity.py).
    scores = torch.cat([processor.score_retrieval(expected[pages:], [page]) for page in expected[:pages]], dim=1)
    for q in range(len(QUERIES)):
        ours_scores = maxsim_scores(got[pages + q].numpy(), [g.numpy() for g in got[:pages]], mean=False)
        np.testing.assert_allclose(ours_scores, scores[q].numpy(), rtol=1e-4)


def test_the_hubs_checkpoint_layout_loads_the_same(model_dir, ours, tmp_path):
    """Checkpoints saved before transformers 5 nest the tower in `vision_tower.vision_model.` and keep the LM
    head (unused) at `language_model.lm_head`."""
    copy = hub_layout_copy(
        model_dir,
        tmp_path / "hub",
        lambda name: name.replace("vlm.vision_tower.", "vlm.vision_tower.vision_model."),
        {"vlm.language_model.lm_head.weight": (8, 64)},
    )
    assert same_parameters(load_ours(copy)[0], ours[0])
