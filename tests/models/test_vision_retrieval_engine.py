"""ColQwen2, ColQwen2.5, ColPali and ColModernVBERT through the engine (in process, or in worker processes with
--data-parallel-size): EmbedMultiVector of page images (encoded PNG/JPEG bytes) and queries in one call equals
transformers on the processors' inputs (ColPaliForRetrieval, ColModernVBertForRetrieval; for ColQwen2 its Qwen2-VL
model given the image grids, M-RoPE, as colpali-engine frames it: tests/helpers/vision_language_models.
colqwen2_reference), Rerank of page images equals the processor's score_retrieval, ListModels says what the model
takes, and bad inputs are refused naming them."""

from __future__ import annotations

import contextlib
import io
from functools import partial

import numpy as np
import pytest
import torch

from tests.helpers.colmodernvbert_models import build_tiny_colmodernvbert
from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm
from tests.helpers.vision_language_models import build_tiny_colpali, build_tiny_colqwen2, colqwen2_reference, page_image

QUERIES = ["what is a socket", "how to parse json files", "x"]
# ColQwen2 keeps sizes that are multiples of 28 and resizes others (300x200 -> 8x6 patches of 28); ColPali
# resizes every page to 28x28; ColModernVBERT to a longest edge of 96, then cuts 48x48 tiles (2x2, 2x1).
PAGES = (((56, 84), "PNG"), ((84, 112), "JPEG"), ((300, 200), "PNG"), ((56, 56), "JPEG"))
BUILDERS = {
    "colqwen2": build_tiny_colqwen2,
    # ColQwen2ForRetrieval over Qwen2.5-VL (its windowed tower through the worker's image plan).
    "colqwen2_5": partial(build_tiny_colqwen2, name="tiny-colqwen2_5", kind="qwen2_5_vl"),
    "colpali": build_tiny_colpali,
    "colmodernvbert": build_tiny_colmodernvbert,
}
MODEL_CLASSES = {
    "colqwen2": "ColQwen2ForRetrieval",
    "colqwen2_5": "ColQwen2ForRetrieval",
    "colpali": "ColPaliForRetrieval",
    "colmodernvbert": "ColModernVBertForRetrieval",
}


def _pages() -> list[bytes]:
    return [page_image(h, w, seed=i, fmt=fmt) for i, ((h, w), fmt) in enumerate(PAGES)]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def served(request, tmp_path_factory):
    """(model directory, a started SyncEngine, transformers' model and processor) per family."""
    import transformers
    from transformers import AutoProcessor

    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    model_dir = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    workers = request.config.getoption("--data-parallel-size")
    config = ModelConfig(
        path=str(model_dir),
        served_name=request.param,
        attention_backend="sdpa",
        dtype="float32",
        data_parallel_size=max(workers, 1),
    )
    model_class = getattr(transformers, MODEL_CLASSES[request.param])
    reference = model_class.from_pretrained(str(model_dir)).eval(), AutoProcessor.from_pretrained(str(model_dir))
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(SyncEngine(config, warm_up=False, worker_processes=workers > 0))
        yield model_dir, engine, reference


def _expected(reference, pages: list[bytes], queries: list[str]) -> list[np.ndarray]:
    from PIL import Image

    model, processor = reference
    batches = [processor.process_images([Image.open(io.BytesIO(data))]) for data in pages]
    batches += [processor.process_queries([query]) for query in queries]
    inputs = [{k: v for k, v in b.items() if k != "labels"} for b in batches]
    if model.config.model_type == "colqwen2":
        return [colqwen2_reference(model, **b)[0].numpy() for b in inputs]
    with torch.no_grad():
        return [model(**b).embeddings[0].numpy() for b in inputs]


def _params(**kwargs):
    from embedserv.types import EmbedOutput, EmbedParams

    return EmbedParams(outputs=(EmbedOutput.MULTI_VECTOR,), **kwargs)


def test_list_models_says_images_and_token_vectors(served):
    from embedserv.types import EmbedOutput, Modality, Task

    _, engine, reference = served
    info = engine.info
    assert info.modalities == (Modality.TEXT, Modality.IMAGE)
    assert info.outputs == (EmbedOutput.MULTI_VECTOR,)
    assert info.multi_vector_dimension == reference[0].config.embedding_dim
    assert Task.EMBED_MULTI_VECTOR in info.tasks and Task.RERANK in info.tasks


def test_pages_and_queries_in_one_call_equal_transformers(served):
    from embedserv.types import ImageInput

    _, engine, reference = served
    pages = _pages()
    # Mixed in one call: the engine packs them longest first; results keep the call's order.
    inputs = [
        ImageInput(pages[0]),
        QUERIES[0],
        ImageInput(pages[1]),
        ImageInput(pages[2]),
        QUERIES[1],
        ImageInput(pages[3]),
        QUERIES[2],
    ]
    expected = _expected(reference, pages, QUERIES)
    order = [0, 4, 1, 2, 5, 3, 6]
    result = engine.embed(inputs, _params())
    for got, index in zip(result.multi_vectors, order, strict=True):
        assert got.shape == expected[index].shape
        assert_cosine_at_least(got, expected[index], 0.9999)
        assert_unit_norm(got)


def test_a_page_alone_equals_it_among_others(served):
    from embedserv.types import ImageInput

    _, engine, _ = served
    pages = [ImageInput(data) for data in _pages()]
    together = engine.embed(pages + QUERIES, _params()).multi_vectors
    for index, page in enumerate(pages):
        alone = engine.embed([page], _params()).multi_vectors[0]
        np.testing.assert_allclose(alone, together[index], rtol=0, atol=5e-5)


def test_rerank_of_pages_equals_score_retrieval(served):
    from embedserv.types import ImageInput, RerankParams

    _, engine, reference = served
    pages = _pages()
    expected = _expected(reference, pages, QUERIES[:1])
    processor = reference[1]
    scores = [
        float(processor.score_retrieval([torch.from_numpy(expected[-1])], [torch.from_numpy(page)])[0, 0])
        for page in expected[:-1]
    ]
    result = engine.rerank(QUERIES[0], [ImageInput(data) for data in pages], RerankParams())
    assert [r.index for r in result.results] == list(np.argsort(scores)[::-1])
    for ranked in result.results:
        np.testing.assert_allclose(ranked.score, scores[ranked.index], rtol=1e-4)
    top = engine.rerank(QUERIES[0], [ImageInput(data) for data in pages], RerankParams(top_n=2))
    assert [r.index for r in top.results] == [r.index for r in result.results[:2]]


def test_bad_inputs_are_refused_naming_them(served):
    from embedserv.errors import InvalidInput
    from embedserv.types import ImageInput, RerankParams

    _, engine, _ = served
    good = _pages()[0]
    with pytest.raises(InvalidInput, match="input 1"):
        engine.embed([ImageInput(good), ImageInput(good[: len(good) // 2])], _params())
    with pytest.raises(InvalidInput, match="prompt_name"):
        engine.embed(["a query"], _params(prompt_name="document"))
    with pytest.raises(InvalidInput, match="takes an image alone; input 0 has text"):
        engine.embed([ImageInput(good, text="a caption")], _params())
    with pytest.raises(InvalidInput, match="document 1 is a text"):
        engine.rerank("q", [ImageInput(good), "a text page"], RerankParams())
    with pytest.raises(InvalidInput, match="image token"):
        token = "<|image_pad|>" if engine.info.architecture.startswith("ColQwen2") else "<image>"
        engine.embed([f"look {token} here"], _params())
    # Token ids used as given: the image token among them would find no features beside it.
    image_token_id = engine.engine.embedding.token_rules.image_token_id
    with pytest.raises(InvalidInput, match="input 1 holds the image token id"):
        engine._call(engine.engine.embedding.embed_token_ids([[5, 6], [5, image_token_id, 6]], _params()))
    # The engine keeps serving after the refusals.
    assert len(engine.embed([ImageInput(good)], _params()).multi_vectors) == 1


def test_a_page_past_the_input_limit_is_refused(served):
    from embedserv.errors import InvalidInput

    _, engine, _ = served
    rules = engine.engine.embedding.token_rules
    if rules.prompts.image_seq_length:
        pytest.skip("ColPali's pages always make image_seq_length tokens")
    if engine.info.architecture == MODEL_CLASSES["colmodernvbert"]:
        # 8x8 tiles and the global image: 65 frames of 9 image tokens, past the 512-token limit.
        with pytest.raises(InvalidInput, match="more than the model's"):
            rules.encode_image(np.zeros((65 * 36, 192), dtype=np.float32), (8, 8), _params())
        return
    side = 2 * int(np.ceil(np.sqrt(engine.info.max_input_tokens)))
    rows = np.zeros((side * side, 1176), dtype=np.float32)
    with pytest.raises(InvalidInput, match="more than the model's"):
        rules.encode_image(rows, (1, side, side), _params())


def _damaged(good: list[bytes], rng: np.random.Generator):
    """Random bytes, valid pages cut short, valid pages with bytes overwritten: in turn."""
    yield rng.integers(0, 256, size=int(rng.integers(0, 300)), dtype=np.uint8).tobytes()
    page = good[int(rng.integers(0, len(good)))]
    yield page[: int(rng.integers(0, len(page)))]
    hit = bytearray(page)
    hit[int(rng.integers(0, len(hit)))] ^= 0xFF
    yield bytes(hit)


def test_damaged_pages_are_served_or_refused_and_the_engine_serves_on(served):
    from embedserv.errors import InvalidInput
    from embedserv.types import ImageInput

    _, engine, _ = served
    good, rng = _pages(), np.random.default_rng(11)
    for _ in range(10):
        for data in _damaged(good, rng):
            try:
                result = engine.embed([QUERIES[0], ImageInput(data)], _params())
            except InvalidInput as exc:
                assert "input 1" in str(exc), str(exc)
            else:
                assert all(np.isfinite(v).all() for v in result.multi_vectors)
    assert len(engine.embed([ImageInput(good[0]), QUERIES[1]], _params()).multi_vectors) == 2
