"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL embedders through the engine in process (SyncEngine, sdpa backend): one Embed
call with images (PNG and JPEG bytes, one with text beside it) and texts equals transformers on the same framing
(tests/helpers/qwen_vl_models.reference_embedding: GME's, Qwen3-VL-Embedding's for Qwen3-VL), in the call's
order; the token ids our rules frame are the reference's; so are inputs of texts and several images interleaved
(reference_interleaved: the processor's chat template), their ids and pixels token for token, and truncation cuts
their texts, never an image; Matryoshka dimensions cut then renormalize; ListModels says what the model takes;
the image token in a text and text beside an image for a model that takes images alone are refused."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm
from tests.helpers.qwen_vl_models import (
    KINDS,
    build_tiny_qwen_vl,
    load_reference,
    reference_embedding,
    reference_interleaved,
)
from tests.helpers.vision_language_models import page_image

# (height, width, format, text beside the image): wide, tall, and one the processor resizes (300x200: over the tiny
# checkpoints' max_pixels; Qwen3-VL-Embedding's own bounds keep it, so it tells the two sizings apart).
PAGES = ((56, 84, "PNG", "what does it show"), (112, 56, "JPEG", ""), (300, 200, "PNG", ""))
TEXTS = ["what is a socket", "x"]


@pytest.fixture(scope="module", params=KINDS)
def served(request, tmp_path_factory):
    """(a started SyncEngine, transformers' reference) per kind."""
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    model_dir = build_tiny_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)
    config = ModelConfig(path=str(model_dir), served_name=request.param, attention_backend="sdpa", dtype="float32")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(SyncEngine(config, warm_up=False, worker_processes=False))
        yield engine, load_reference(model_dir)


def _pages() -> list[tuple[bytes, str]]:
    return [(page_image(h, w, seed=i, fmt=fmt), text) for i, (h, w, fmt, text) in enumerate(PAGES)]


def _expected(reference, pages, texts) -> list[np.ndarray]:
    from PIL import Image

    out = [reference_embedding(reference, text, Image.open(io.BytesIO(data)))[0] for data, text in pages]
    return [v.numpy() for v in out] + [reference_embedding(reference, text)[0].numpy() for text in texts]


def _inputs(pages, texts) -> list:
    """Texts and images interleaved: text, image, image, text, image."""
    from embedserv.types import ImageInput

    images = [ImageInput(data, text=text) for data, text in pages]
    return [texts[0], images[0], images[1], texts[1], images[2]]


def test_list_models_says_images_and_last_token_pooling(served):
    from embedserv.types import Modality, Task

    info = served[0].info
    assert info.modalities == (Modality.TEXT, Modality.IMAGE)
    assert info.pooling == "lasttoken" and info.dimension == 64
    assert Task.EMBED in info.tasks


def test_images_texts_and_an_image_with_text_in_one_call_equal_transformers(served):
    from embedserv.types import EmbedParams

    engine, reference = served
    pages = _pages()
    expected = _expected(reference, pages, TEXTS)
    order = [3, 0, 1, 4, 2]
    result = engine.embed(_inputs(pages, TEXTS), EmbedParams())
    assert result.embeddings.shape == (5, 64)
    for got, index in zip(result.embeddings, order, strict=True):
        assert_cosine_at_least(got[None], expected[index][None], 0.9999)
        np.testing.assert_allclose(got, expected[index], rtol=0, atol=2e-4)
    assert_unit_norm(result.embeddings)
    # An input alone gives what it gave among the others.
    alone = engine.embed(_inputs(pages, TEXTS)[1:2], EmbedParams()).embeddings[0]
    np.testing.assert_allclose(alone, result.embeddings[1], rtol=0, atol=5e-5)


def test_our_framing_is_the_references_token_for_token(served):
    from PIL import Image

    from embedserv.engine.inputs.images import prepare_image
    from embedserv.types import EmbedParams

    engine, reference = served
    rules = engine.engine.embedding.token_rules
    vision = engine.engine.served.vision
    (data, text), params = _pages()[0], EmbedParams()
    rows, grid = prepare_image(data, 0, vision.processing, vision.limits)
    got = rules.encode_image(rows, grid, params, text)
    _, batch = reference_embedding(reference, text, Image.open(io.BytesIO(data)))
    assert got.ids == batch["input_ids"][0].tolist()
    np.testing.assert_allclose(got.pixels, batch["pixel_values"].numpy(), rtol=0, atol=1e-5)
    assert [s.ids for s in rules.encode_texts(engine.engine.served.tokenizer, TEXTS, params)] == [
        reference_embedding(reference, t)[1]["input_ids"][0].tolist() for t in TEXTS
    ]


def test_matryoshka_dimensions_cut_then_renormalize(served):
    from embedserv.types import EmbedParams

    engine, reference = served
    pages = _pages()
    full = _expected(reference, pages[:1], [])[0][:16]
    got = engine.embed(_inputs(pages, TEXTS)[1:2], EmbedParams(dimensions=16)).embeddings[0]
    np.testing.assert_allclose(got, full / np.linalg.norm(full), rtol=0, atol=2e-4)


def test_the_image_token_in_a_text_is_refused(served):
    from embedserv.errors import InvalidInput
    from embedserv.types import EmbedParams, ImageInput

    engine, _ = served
    with pytest.raises(InvalidInput, match="image token"):
        engine.embed(["look <|image_pad|> here"], EmbedParams())
    with pytest.raises(InvalidInput, match="image token"):
        engine.embed([ImageInput(_pages()[0][0], text="and <|image_pad|>")], EmbedParams())
    assert engine.embed([ImageInput(_pages()[0][0])], EmbedParams()).embeddings.shape == (1, 64)


def _interleaved(pages) -> list:
    """Two inputs of texts and images interleaved (two images; three, text first), among an image with text and a
    text; as engine inputs and as the reference's parts (PIL images)."""
    from PIL import Image

    from embedserv.types import ImageInput, InterleavedInput

    (wide, text), (tall, _), (large, _) = pages
    parts = [("compare", wide, "with", tall), ("a chart", large, tall, "and", wide)]
    inputs = [InterleavedInput(parts[0]), ImageInput(wide, text), InterleavedInput(parts[1]), TEXTS[0]]
    pil = [[Image.open(io.BytesIO(p)) if isinstance(p, bytes) else p for p in group] for group in parts]
    references = [pil[0], [Image.open(io.BytesIO(wide)), text], pil[1], [TEXTS[0]]]
    return inputs, references


def test_interleaved_inputs_in_one_call_equal_transformers(served):
    from embedserv.types import EmbedParams

    engine, reference = served
    inputs, references = _interleaved(_pages())
    result = engine.embed(inputs, EmbedParams())
    for got, parts in zip(result.embeddings, references, strict=True):
        expected = reference_interleaved(reference, parts)[0].numpy()
        assert_cosine_at_least(got[None], expected[None], 0.9999)
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-4)
    alone = engine.embed(inputs[2:3], EmbedParams()).embeddings[0]
    np.testing.assert_allclose(alone, result.embeddings[2], rtol=0, atol=5e-5)


def test_interleaved_framing_is_the_processors_chat_template_token_for_token(served):
    from embedserv.engine.inputs.images import prepare_image
    from embedserv.types import EmbedParams

    engine, reference = served
    rules, vision = engine.engine.embedding.token_rules, engine.engine.served.vision
    inputs, references = _interleaved(_pages())
    for parts, pil in zip((inputs[0].parts, inputs[2].parts), (references[0], references[2]), strict=True):
        prepared = [p if isinstance(p, str) else prepare_image(p, 0, vision.processing, vision.limits) for p in parts]
        got = rules.encode_interleaved(prepared, EmbedParams(), "input 0")
        _, batch = reference_interleaved(reference, pil)
        assert got.ids == batch["input_ids"][0].tolist()
        assert got.image_grids == tuple(map(tuple, batch["image_grid_thw"].tolist()))
        np.testing.assert_allclose(got.pixels, batch["pixel_values"].numpy(), rtol=0, atol=1e-5)


def test_truncate_cuts_texts_never_an_image(served):
    """RIGHT cuts the last text first, then the one before; LEFT the first text first; without truncate, too long
    is refused; images that leave no room, and more than an input may hold, are refused either way."""
    from embedserv.engine.inputs.vl_embed_rules import MAX_IMAGES_PER_INPUT
    from embedserv.errors import InvalidInput
    from embedserv.types import EmbedParams, InterleavedInput, TruncationDirection

    engine, _ = served
    rules = engine.engine.embedding.token_rules
    tokenizer = rules.tokenizer
    limit, start = tokenizer.max_input_tokens, tokenizer.token_id("<|vision_start|>")
    end, short = tokenizer.encode_text(rules.framing.end), "what is shown"
    image = (np.zeros((16, 4), np.float32), (1, 4, 4))
    parts, fitting = [short, image, " word" * limit, image, short], [short, image, short, image, short]
    encode = rules.encode_interleaved
    with pytest.raises(InvalidInput, match="input 0 has .* tokens, more than the model's limit of"):
        encode(parts, EmbedParams(truncate=False), "input 0")
    whole = encode(fitting, EmbedParams(), "input 0").ids
    right = encode(parts, EmbedParams(truncate=True), "input 0").ids
    left = encode(parts, EmbedParams(truncate=True, truncation_direction=TruncationDirection.LEFT), "input 0").ids
    first, tail = whole.index(start), len(tokenizer.encode_text(short)) + len(end)
    for ids in (right, left):
        assert len(ids) == limit and ids.count(rules.image_token_id) == whole.count(rules.image_token_id) == 8
    # RIGHT keeps the head and the first text, and has cut the last text whole (the image's end, then the frame's).
    assert right[: first + 1] == whole[: first + 1] and right[-len(end) - 1 :] == whole[-tail - 1 : -tail] + end
    # LEFT has cut the first text whole (the head, then the first image) and keeps the last text.
    assert left.index(start) == first - (tail - len(end)) and left[-tail:] == whole[-tail:]
    crowded = (np.zeros((256, 4), np.float32), (1, 16, 16))
    with pytest.raises(InvalidInput, match="its images and the prompt alone make .* send fewer or smaller images"):
        encode([crowded] * (limit // 66 + 1) + [short], EmbedParams(truncate=True), "input 0")
    images = (_pages()[0][0],) * (MAX_IMAGES_PER_INPUT + 1)
    with pytest.raises(InvalidInput, match=f"input 1 holds {MAX_IMAGES_PER_INPUT + 1} images; one input takes at"):
        engine.embed(["x", InterleavedInput(images)], EmbedParams())


def test_qwen3_vl_instructions_end_in_punctuation_as_its_embedder_makes_them():
    """Qwen3-VL-Embedding's format_model_input: the default "Represent the user's input.", an instruction stripped
    and given a "." unless it ends in punctuation; GME's frame takes instructions as they are."""
    from embedserv.engine.inputs.vl_embed_rules import FRAMINGS

    qwen3, gme = FRAMINGS["qwen3_vl"], FRAMINGS["qwen2_vl"]
    assert qwen3.instruction(None) == "Represent the user's input."
    assert qwen3.instruction("  Find the chart  ") == "Find the chart."
    assert qwen3.instruction("Which chart?") == "Which chart?"
    assert gme.instruction(None) == "You are a helpful assistant." and gme.instruction("Find it") == "Find it"
    assert qwen3.end.endswith("<|im_start|>assistant\n") and gme.end.endswith("<|endoftext|>")


def test_rerank_scores_image_documents_by_the_cosine_of_transformers_vectors(served):
    """An embedder reranks images, an image with text and texts by the cosine of their vectors with the query's."""
    from embedserv.types import ImageInput, RerankParams

    engine, reference = served
    pages, query = _pages()[:2], "what is shown"
    documents = [ImageInput(data, text=text) for data, text in pages] + [TEXTS[0]]
    vectors = _expected(reference, pages, [query, TEXTS[0]])
    expected = np.array([vectors[0], vectors[1], vectors[3]]) @ vectors[2]
    result = engine.rerank(query, documents, RerankParams())
    assert [r.index for r in result.results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r.score for r in result.results], np.sort(expected)[::-1], rtol=0, atol=2e-4)
