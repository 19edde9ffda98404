"""Qwen3-VL-Reranker-style yes/no reranking through the engine in process (SyncEngine, sdpa, float32) on a tiny
random-weight Qwen3VLForConditionalGeneration whose LM head is tied (Qwen3-VL-2B's: the checkpoint holds no
lm_head), in a directory whose name says "reranker": each pair's score equals transformers' sigmoid(logit("yes") -
logit("no")) at the last token of its scripts/qwen3_vl_reranker.py prompt rendered by Qwen3-VL's chat template
(tests/helpers/qwen_vl_rerank.py), token for token, for text documents, image documents of three sizes (one larger
than preprocessor_config.json keeps, sized as the script sizes it), an image with text, an empty document
("NULL"), an image query with text and image documents, a custom instruction and a cut document; the ranking follows the
scores, raw_scores gives the logit difference. What the model cannot take is refused saying what to change."""

from __future__ import annotations

import io
import re
import shutil

import numpy as np
import pytest

from embedserv.errors import ConfigError, InvalidInput
from embedserv.types import ImageInput, InterleavedInput, RerankParams
from tests.helpers.qwen_vl_models import build_tiny_qwen_vl, load_reference
from tests.helpers.qwen_vl_rerank import DEFAULT_INSTRUCTION, PIXELS, messages, reference_logit
from tests.helpers.vision_language_models import _qwen_tokenizer, page_image

ATOL = 1e-4
WIDE = page_image(64, 96, seed=1)
TALL = page_image(128, 64, seed=2, fmt="JPEG")
QUERY = "which chart shows the sales"
# Larger than the checkpoint's preprocessor_config.json lets it stay (192 x 192 at most); within the script's bounds.
LARGE = page_image(200, 300, seed=3)
DOCUMENTS = [
    "a socket is one endpoint of a connection",
    ImageInput(WIDE),
    ImageInput(TALL, "a receipt from the shop"),
    "",
    ImageInput(LARGE),
    "sales by month, as a bar chart",
]
LONG = " ".join(f"line {i} of the sales report" for i in range(120))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen_vl(
        tmp_path_factory.mktemp("vl"), "qwen3_vl", seed=1, name="tiny-qwen3-vl-reranker", tied=True
    )


@pytest.fixture(scope="module")
def served(model_dir):
    """(a started SyncEngine, transformers' reference)."""
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    config = ModelConfig(path=str(model_dir), served_name="vl-reranker", attention_backend="sdpa", dtype="float32")
    with SyncEngine(config, warm_up=False, worker_processes=False) as engine:
        yield engine, load_reference(model_dir, PIXELS)


def _pil(item):
    from PIL import Image

    return Image.open(io.BytesIO(item.data)) if isinstance(item, ImageInput) else None


def _text(item) -> str:
    return item.text if isinstance(item, ImageInput) else item


def _expected(reference, query, documents, instruction=None, max_length=None) -> tuple[np.ndarray, list]:
    """The reference's logit differences and ids, one pair per document."""
    out = [
        reference_logit(
            reference,
            messages(_text(query), _text(d), _pil(query), _pil(d), instruction),
            max_length,
        )
        for d in documents
    ]
    return np.array([logit for logit, _ in out]), [ids for _, ids in out]


def _scores(result, count: int) -> np.ndarray:
    scores = np.zeros(count)
    for ranked in result.results:
        scores[ranked.index] = ranked.score
    return scores


def _check(engine, reference, query, documents, params=None, max_length=None):
    """Scores (and raw logits) equal the reference's; the ranking is theirs, best first; our ids are theirs."""
    params = params or RerankParams()
    logits, ids = _expected(reference, query, documents, params.instruction, max_length)
    result = engine.rerank(query, documents, params)
    expected = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(_scores(result, len(documents)), expected, rtol=0, atol=ATOL)
    assert [r.index for r in result.results] == list(np.argsort(-expected, kind="stable"))
    raw = engine.rerank(query, documents, RerankParams(raw_scores=True, **_fields(params)))
    np.testing.assert_allclose(_scores(raw, len(documents)), logits, rtol=0, atol=ATOL)
    rules, instruction = engine.engine.reranking._rules, params.instruction or DEFAULT_INSTRUCTION
    ours = rules.encode_pairs(query, documents, instruction, bool(params.truncate))
    assert [s.ids for s in ours] == ids
    assert logits.std() > 0.05, "the pairs must score apart"


def _fields(params: RerankParams) -> dict:
    return {"instruction": params.instruction, "truncate": params.truncate}


def test_listed_as_a_yes_no_reranker_that_takes_images(served, model_dir):
    from embedserv.models.loading.checkpoint import has_tensor
    from embedserv.types import Modality, Task

    info = served[0].info
    assert info.tasks == (Task.RERANK,) and info.pooling == "lasttoken"
    assert info.modalities == (Modality.TEXT, Modality.IMAGE)
    # Images sized as the script sizes them (4 to 1,280 merged 32 x 32 blocks), not as preprocessor_config.json says.
    assert served[0].engine.served.vision.processing.resize == ("pixels", *PIXELS)
    # Tied as Qwen3-VL-2B: the yes/no rows come from the token embeddings.
    assert not has_tensor([model_dir / "model.safetensors"], "lm_head.weight")


def test_text_image_and_image_with_text_documents_equal_transformers(served):
    _check(*served, QUERY, DOCUMENTS)


def test_an_image_query_with_text_and_image_documents_equals_transformers(served):
    """The query's image and a document's in one pair: both in the sequence, the query's first."""
    _check(*served, ImageInput(TALL, "the total of this receipt"), DOCUMENTS)
    _check(*served, ImageInput(WIDE), [DOCUMENTS[0], ImageInput(LARGE), ImageInput(TALL, "a receipt")])


def test_a_custom_instruction_equals_transformers(served):
    instruction = "Given a picture, find the caption that describes it."
    engine, reference = served
    _check(engine, reference, QUERY, DOCUMENTS[:3], RerankParams(instruction=instruction))
    default = engine.rerank(QUERY, DOCUMENTS[:3], RerankParams())
    changed = engine.rerank(QUERY, DOCUMENTS[:3], RerankParams(instruction=instruction))
    assert np.abs(_scores(default, 3) - _scores(changed, 3)).max() > 1e-3


def test_truncate_cuts_the_documents_text_as_transformers_would(served):
    engine, reference = served
    limit = engine.info.max_input_tokens
    documents = [LONG, ImageInput(WIDE, LONG), "short"]
    _check(engine, reference, QUERY, documents, RerankParams(truncate=True), max_length=limit)
    lengths = [len(s.ids) for s in engine.engine.reranking._rules.encode_pairs(QUERY, documents, "x", True)]
    assert lengths[:2] == [limit, limit] and lengths[2] < limit
    with pytest.raises(
        InvalidInput, match=f"the prompt for document 0 has \\d+ tokens, more than the model's limit of {limit}"
    ):
        engine.rerank(QUERY, documents, RerankParams(truncate=False))
    with pytest.raises(InvalidInput, match="leaves no room for document 0's text; shorten the query"):
        engine.rerank(LONG * 2, documents, RerankParams(truncate=True))


@pytest.mark.parametrize(
    ("query", "documents", "params", "says"),
    [
        (QUERY, ["a", InterleavedInput(("b", TALL, "c"))], RerankParams(), "document 1 holds texts and images"),
        (QUERY, ["a", ImageInput(TALL)], RerankParams(chunking=True), "chunking applies to text documents; document 1"),
        (QUERY, ["a"], RerankParams(chunking=True), "is a yes/no reranker and cannot score documents by windows"),
        (QUERY, ["a", "b <|image_pad|>"], RerankParams(), "document 1 holds the image token '<|image_pad|>'"),
        (ImageInput(WIDE, "<|image_pad|>"), ["a"], RerankParams(), "the query holds the image token"),
        (QUERY, [ImageInput(b"not an image")], RerankParams(), "input 1 is not a PNG, JPEG or WebP image"),
    ],
)
def test_what_it_cannot_take_is_refused_saying_what_to_change(served, query, documents, params, says):
    with pytest.raises(InvalidInput, match=re.escape(says)):
        served[0].rerank(query, documents, params)


def test_detection_follows_the_path_or_the_flag():
    from embedserv.models.loading.tasks import is_decoder_reranker

    arch = "Qwen3VLForConditionalGeneration"
    assert is_decoder_reranker("/hub/models--Qwen--Qwen3-VL-Reranker-2B", arch, None)
    assert not is_decoder_reranker("/hub/models--Qwen--Qwen3-VL-Embedding-2B", arch, None)
    assert is_decoder_reranker("/models/mine", arch, True)
    assert not is_decoder_reranker("/models/a-reranker", arch, False)
    assert not is_decoder_reranker("/models/a-reranker", "Qwen2VLForConditionalGeneration", None)


def test_the_yes_no_rows_come_from_each_layout_and_tie(tmp_path):
    """The older layouts' embeddings (`model.embed_tokens`) when tied, `lm_head` when not; text_config's tie counts."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3VLConfig

    from embedserv.models.families.qwen3_vl import FAMILY
    from embedserv.models.heads.score import YesNoTokens, build_yes_no_head
    from embedserv.worker.replica import _ties_embeddings

    embeddings, head = torch.randn(8, 4), torch.randn(8, 4)
    files = [tmp_path / "model.safetensors"]
    save_file({"model.embed_tokens.weight": embeddings, "lm_head.weight": head}, files[0])
    tokens = YesNoTokens(yes_id=5, no_id=2)
    tied = build_yes_no_head(FAMILY, 4, tokens, True, files).out.weight[0]
    untied = build_yes_no_head(FAMILY, 4, tokens, False, files).out.weight[0]
    torch.testing.assert_close(tied, embeddings[5] - embeddings[2])
    torch.testing.assert_close(untied, head[5] - head[2])

    class Spec:
        family = FAMILY
        hf_config = Qwen3VLConfig(text_config={"tie_word_embeddings": True})

    assert _ties_embeddings(Spec)
    Spec.hf_config = Qwen3VLConfig()
    assert not _ties_embeddings(Spec)


def test_a_tokenizer_without_yes_and_no_is_refused_at_start_up(model_dir, tmp_path):
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    copy = shutil.copytree(model_dir, tmp_path / "no-yes-reranker")
    _qwen_tokenizer(copy)
    config = ModelConfig(path=str(copy), served_name="x", dtype="float32")
    with pytest.raises(ConfigError, match="a yes/no reranker needs 'yes' and 'no' tokens; its tokenizer lacks them"):
        with SyncEngine(config, warm_up=False, worker_processes=False):
            pass
