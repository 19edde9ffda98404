"""ColQwen2 and ColQwen2.5 on tiny random models against colpali-engine's framing in transformers: the checkpoint's
Qwen2-VL / Qwen2.5-VL model (ColQwen2ForRetrieval.vlm, as its vlm_config names it) given the ids, pixels and image
grids, so it rotates by M-RoPE, then the projection and L2 norm (tests/helpers/vision_language_models.
colqwen2_reference). Page-image and query vectors (cosine >= 0.9999 per vector, as many vectors) of pages of several
sizes and aspect ratios (Qwen2.5-VL's windows cut short on some), MaxSim against the processor's score_retrieval, a
packed pass mixing image sizes and queries with padding rows, queries alone, batch invariance, and the vision
tower's parts; and that pages differ from ColQwen2ForRetrieval's 1-D framing."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.metadata import build_common_metadata
from embedserv.engine.tasks.multi_vector import maxsim_scores
from embedserv.forward_context import set_forward_context
from embedserv.models.families.qwen2_vision import patch_positions
from embedserv.worker.layer_routes import forward_context_for
from tests.helpers.compare import assert_cosine_at_least
from tests.helpers.vision_language_models import (
    COLQWEN2_SIZES,
    build_tiny_colqwen2,
    colqwen2_reference,
    hub_layout_copy,
    load_ours,
    packed_vectors,
    page_image,
    same_parameters,
    vision_metadata,
)

QUERIES = ["what is a socket", "how to parse json files", "x"]


# The model ColQwen2ForRetrieval nests: Qwen2-VL (ColQwen2) or Qwen2.5-VL (ColQwen2.5, windowed tower).
KINDS = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="module", params=KINDS)
def model_dir(request, tmp_path_factory):
    return build_tiny_colqwen2(tmp_path_factory.mktemp(request.param), kind=request.param)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor

    model = ColQwen2ForRetrieval.from_pretrained(str(model_dir)).eval()
    return model, ColQwen2Processor.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def ours(model_dir):
    model, head, causal = load_ours(model_dir)
    assert causal, "ColQwen2's language model runs causal in transformers"
    return model, head, causal


def _images(fmt: str = "PNG"):
    from PIL import Image

    return [Image.open(io.BytesIO(page_image(h, w, seed=i, fmt=fmt))) for i, (h, w) in enumerate(COLQWEN2_SIZES)]


def _inputs(processor, images, queries):
    """Per input (ids, pixel rows or None, grid or ()), each processed alone (no padding)."""
    out = []
    for image in images:
        batch = processor.process_images([image])
        out.append((batch["input_ids"][0], batch["pixel_values"][0], tuple(batch["image_grid_thw"][0].tolist())))
    for query in queries:
        out.append((processor.process_queries([query])["input_ids"][0], None, ()))
    return out


def _expected(reference, items, framing=colqwen2_reference) -> list[torch.Tensor]:
    """Each item's vectors alone; `framing(model, **batch)` -> [1, tokens, dim]."""
    model, _ = reference
    out = []
    for ids, rows, grid in items:
        kwargs = {} if rows is None else {"pixel_values": rows[None], "image_grid_thw": torch.tensor([grid])}
        out.append(framing(model, input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], **kwargs)[0])
    return out


def _retrieval_model(model, **batch) -> torch.Tensor:
    """transformers' ColQwen2ForRetrieval itself (1-D positions)."""
    with torch.no_grad():
        return model(**batch).embeddings


def _assert_vectors_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert [len(g) for g in got] == [len(e) for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert_cosine_at_least(g.numpy(), e.numpy(), 0.9999)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_page_images_and_queries_in_one_pass_equal_transformers(ours, reference, fmt):
    items = _inputs(reference[1], _images(fmt), QUERIES)
    # Longest first, as the scheduler packs them: images and queries interleaved by length.
    items.sort(key=lambda item: -len(item[0]))
    _assert_vectors_equal(packed_vectors(*ours, items, pad_tokens=5, pad_rows=7), _expected(reference, items))


def test_queries_alone_equal_transformers(ours, reference):
    items = _inputs(reference[1], [], QUERIES)
    _assert_vectors_equal(packed_vectors(*ours, items, pad_tokens=3), _expected(reference, items))


def test_pages_differ_from_the_retrieval_classes_1d_framing_and_queries_do_not(ours, reference):
    """The framing is visible: M-RoPE moves page vectors away from ColQwen2ForRetrieval's (plain positions), while
    a query's positions are plain in both."""
    items = _inputs(reference[1], _images(), QUERIES[:1])
    got = packed_vectors(*ours, items)
    one_d = _expected(reference, items, framing=_retrieval_model)
    for page, old in zip(got[:-1], one_d[:-1], strict=True):
        cosines = torch.nn.functional.cosine_similarity(page, old, dim=-1)
        assert float(cosines.min()) < 0.999
    assert_cosine_at_least(got[-1].numpy(), one_d[-1].numpy(), 0.9999)


def test_queries_under_mrope_are_plain_rope_bit_for_bit(ours, reference):
    """A text's three position rows are equal, so M-RoPE gives it the bits 1-D positions give."""
    items = _inputs(reference[1], [], QUERIES)
    model = ours[0]
    mrope = packed_vectors(*ours, items, pad_tokens=3)
    spec, model.mrope = model.mrope, None
    try:
        plain = packed_vectors(*ours, items, pad_tokens=3)
    finally:
        model.mrope = spec
    assert spec is not None
    for a, b in zip(mrope, plain, strict=True):
        assert torch.equal(a, b)


def test_image_grids_differ_and_tokens_follow_them(reference):
    items = _inputs(reference[1], _images(), [])
    grids = [grid for _, _, grid in items]
    assert len(set(grids)) == len(grids)
    image_token = reference[0].config.vlm_config.image_token_id
    for ids, rows, (t, h, w) in items:
        assert len(rows) == t * h * w and int((ids == image_token).sum()) == t * h * w // 4


def test_an_input_alone_equals_it_packed_with_others(ours, reference):
    items = _inputs(reference[1], _images(), QUERIES)
    packed = packed_vectors(*ours, items)
    for index, item in enumerate(items):
        alone = packed_vectors(*ours, [item])[0]
        torch.testing.assert_close(alone, packed[index], rtol=0, atol=2e-5)


def test_maxsim_equals_the_processors_score_retrieval(ours, reference):
    processor = reference[1]
    items = _inputs(processor, _images(), QUERIES)
    got = packed_vectors(*ours, items)
    expected = _expected(reference, items)
    pages, queries = len(COLQWEN2_SIZES), len(QUERIES)
    # One page per call: score_retrieval pads a batch of pages with zero vectors, so a query vector whose dot
    # products with a shorter page are all negative would take 0 from the padding, a score that depends on
    # the other pages of the call; MaxSim over the page's own vectors is the score it means.
    scores = torch.cat([processor.score_retrieval(expected[pages:], [page]) for page in expected[:pages]], dim=1)
    assert scores.shape == (queries, pages)
    for q in range(queries):
        ours_scores = maxsim_scores(got[pages + q].numpy(), [g.numpy() for g in got[:pages]], mean=False)
        np.testing.assert_allclose(ours_scores, scores[q].numpy(), rtol=1e-4)


def test_vision_tower_equals_transformers_visual(ours, reference):
    model = ours[0]
    items = _inputs(reference[1], _images(), [])
    rows = torch.cat([r for _, r, _ in items])
    grids = tuple(g for _, _, g in items)
    backend = NaiveBackend()
    vision, windows = vision_metadata(backend, model, grids, [len(r) for _, r, _ in items])
    text = backend.build_metadata(build_common_metadata(np.array([1]), True))
    context = forward_context_for(model, backend, text, encoder_metadata=vision, window_metadata=windows)
    with torch.inference_mode(), set_forward_context(context):
        got = model.visual(rows, grids)
    with torch.no_grad():
        expected = reference[0].vlm.visual(rows, grid_thw=torch.tensor(grids), return_dict=True).pooler_output
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_patch_positions_equal_transformers():
    from transformers.vision_utils import get_vision_position_ids

    grids = ((1, 4, 6), (1, 6, 8), (2, 2, 4))
    expected = get_vision_position_ids(torch.tensor(grids), 2).numpy()
    got = patch_positions(grids, 2, len(expected) + 3)
    np.testing.assert_array_equal(got[: len(expected)], expected)
    assert not got[len(expected) :].any()


def test_the_hubs_checkpoint_layout_loads_the_same(model_dir, ours, tmp_path):
    """Checkpoints saved before transformers 5 nest the model under `vlm.model.` beside an unused `vlm.lm_head`."""
    copy = hub_layout_copy(
        model_dir,
        tmp_path / "hub",
        lambda name: name.replace("vlm.", "vlm.model.", 1),
        {"vlm.lm_head.weight": (8, 64)},
    )
    assert same_parameters(load_ours(copy)[0], ours[0])


def test_the_tower_is_the_nested_models(ours, reference):
    """vlm_config's model type picks the tower, as transformers' AutoModel picks the model."""
    from embedserv.models.families.colqwen2 import TOWERS

    kind = reference[0].vlm.config.model_type
    assert type(reference[0].vlm).__name__ == {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel"}[kind]
    assert type(ours[0].visual) is TOWERS[kind]
    assert (ours[0].vision_windows is not None) == (kind == "qwen2_5_vl")


def test_a_nested_model_we_do_not_run_is_refused_naming_it():
    from types import SimpleNamespace

    from embedserv.errors import ConfigError
    from embedserv.models.families.colqwen2 import ColQwen2Model

    with pytest.raises(ConfigError, match="'qwen3_vl'.*qwen2_5_vl, qwen2_vl"):
        ColQwen2Model.tower_for(SimpleNamespace(model_type="qwen3_vl"))


def _colpali_engine_copy(model_dir, out, dim):
    """The directory as colpali-engine saves a (merged) ColQwen2 / ColQwen2.5: the Qwen2(.5)-VL config itself in
    its pre-5 flat form (text settings at the top), architectures ColQwen2 / ColQwen2_5, the language model under
    `model.`, the tower under `visual.`, the projection `custom_text_proj`, an unused lm_head."""
    import json

    def rename(name: str) -> str:
        name = name.replace("vlm.language_model.", "model.", 1).replace("vlm.visual.", "visual.", 1)
        return name.replace("embedding_proj_layer.", "custom_text_proj.", 1)

    copy = hub_layout_copy(model_dir, out, rename, {"lm_head.weight": (8, 64)})
    vlm = json.loads((model_dir / "config.json").read_text())["vlm_config"]
    raw = {**vlm.pop("text_config"), **vlm}
    raw["architectures"] = ["ColQwen2_5" if raw["model_type"] == "qwen2_5_vl" else "ColQwen2"]
    if dim is not None:
        raw["dim"] = dim
    (copy / "config.json").write_text(json.dumps(raw))
    return copy


def test_colpali_engines_checkpoint_layout_loads_the_same(model_dir, ours, tmp_path):
    from embedserv.models.loading.hf_config import read_hf_config

    copy = _colpali_engine_copy(model_dir, tmp_path / "colpali-engine", dim=ours[1].proj.out_features)
    config = read_hf_config(copy)
    assert config.model_type == "colqwen2" and config.architectures == ["ColQwen2ForRetrieval"]
    assert config.vlm_config.model_type == read_hf_config(model_dir).vlm_config.model_type
    assert config.embedding_dim == ours[1].proj.out_features
    model, head, causal = load_ours(copy)
    assert causal and same_parameters(model, ours[0]) and same_parameters(head, ours[1])


def test_colpali_engines_width_defaults_to_128_and_other_qwen_vl_configs_stay_theirs():
    from embedserv.models.families.colqwen2 import colpali_engine_config

    raw = {"model_type": "qwen2_5_vl", "architectures": ["ColQwen2_5"], "hidden_size": 64}
    assert colpali_engine_config(raw)["embedding_dim"] == 128
    assert colpali_engine_config(raw)["vlm_config"] == {"model_type": "qwen2_5_vl", "hidden_size": 64}
    assert colpali_engine_config({**raw, "architectures": ["Qwen2_5_VLForConditionalGeneration"]}) is None


def test_an_adapter_directory_is_refused_saying_to_merge_it(tmp_path):
    import json

    from embedserv.errors import ConfigError
    from embedserv.models.loading.hf_config import read_hf_config

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "vidore/colqwen2.5-base"}))
    with pytest.raises(ConfigError, match="PEFT adapter.*over vidore/colqwen2.5-base: merge it"):
        read_hf_config(tmp_path)
