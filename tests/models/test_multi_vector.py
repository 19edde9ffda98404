"""EmbedMultiVector and MaxSim rerank equal sentence-transformers' MultiVectorEncoder on the same weights.

Small random-weight BERT MultiVectorEncoders (two token-level Dense layers, Normalize, MultiVectorMask)
saved by the library itself, run through our engine in process, float32; the oracles are
MultiVectorEncoder.encode_query / encode_document / encode and similarity. Models the library runs in a
way we cannot reproduce are refused at start-up. The bundled all-MiniLM-L6-v2 covers the last-hidden-state
token vectors of a plain embedder against transformers.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from benchmarks.corpus import stdlib_texts
from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm
from tests.helpers.multi_vector_models import (
    DIMENSION,
    build_multi_vector_encoder,
    edited_copy,
    load_multi_vector_reference,
    read_json,
)

MIN_COSINE = 0.9999
# Model A: prompts, a skiplist (one word is not a single token: dropped, as the library drops it), queries
# expanded to 12 tokens ("min": longer ones cut at query_length 20), documents cut at 40.
MODEL_A = dict(
    prompts={"query": "query: ", "document": "passage: "},
    skiplist_words=[".", ",", "the", "(", ")", "zzqxw"],
    query_length=20,
    document_length=40,
    query_expansion={"strategy": "min", "attend": True, "length": 12},
)


def _params(prompt_name, **kwargs):
    from embedserv.types import EmbedOutput, EmbedParams

    return EmbedParams(outputs=(EmbedOutput.MULTI_VECTOR,), prompt_name=prompt_name, **kwargs)


@pytest.fixture(scope="module")
def sample() -> list[str]:
    """Texts longer than every cap, middling ones, and short ones (expanded as queries)."""
    return [*stdlib_texts(8, seed=3), "what is a list?", "sort it.", "the (the) the", "x"]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("multi-vector-models")


@pytest.fixture(scope="module")
def engines(request):
    """Factory: engines(model_dir) -> a started SyncEngine, shared in the module: in this process, or with
    `--data-parallel-size N` in N worker processes as the server runs models (those always warm up)."""
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    workers = request.config.getoption("--data-parallel-size")
    started: dict[str, SyncEngine] = {}
    with contextlib.ExitStack() as stack:

        def get(model_dir, warm_up: bool = False):
            if str(model_dir) not in started:
                config = ModelConfig(
                    path=str(model_dir),
                    served_name="m",
                    attention_backend="sdpa",
                    dtype="float32",
                    data_parallel_size=max(workers, 1),
                )
                engine = SyncEngine(config, warm_up=warm_up, worker_processes=workers > 0)
                started[str(model_dir)] = stack.enter_context(engine)
            return started[str(model_dir)]

        yield get


@pytest.fixture(scope="module")
def model_a(model_root):
    model_dir = build_multi_vector_encoder(model_root, **MODEL_A)
    return model_dir, load_multi_vector_reference(model_dir)


def _assert_same_vectors(actual: list[np.ndarray], expected, texts: list[str], what: str) -> None:
    """Same number of vectors per input as the library, each at cosine >= MIN_COSINE, unit norm."""
    assert len(actual) == len(expected)
    for index, (ours, theirs) in enumerate(zip(actual, expected, strict=True)):
        theirs = np.asarray(theirs)
        assert ours.dtype == np.float32
        where = f"{what}: input {index} ({texts[index][:40]!r})"
        assert ours.shape == theirs.shape, f"{where}: {ours.shape} vectors, the library {theirs.shape}"
        if len(ours):
            assert_cosine_at_least(ours, theirs, MIN_COSINE, what=f"{what}: input {index}: ")
            assert_unit_norm(ours)


@pytest.mark.parametrize("task", ["query", "document", None])
def test_token_vectors_match_the_library(task, model_a, engines, sample):
    """prompt_name "query" is encode_query, "document" encode_document, none is encode() without a task."""
    model_dir, reference = model_a
    encode = {"query": reference.encode_query, "document": reference.encode_document, None: reference.encode}[task]
    expected = encode(sample, convert_to_numpy=True)

    result = engines(model_dir, warm_up=True).embed(sample, _params(task, truncate=True))

    _assert_same_vectors(result.multi_vectors, expected, sample, f"task {task}")
    assert result.embeddings is None and result.sparse is None
    counts = [len(v) for v in result.multi_vectors]
    if task == "query":
        # Short queries were expanded to 12 tokens, long ones cut at query_length 20.
        assert min(counts) == 12 and max(counts) == 20
    elif task == "document":
        # Cut at document_length 40, fewer once the skiplist drops tokens.
        assert max(counts) < 40
    else:
        assert max(counts) > 40, "without a task only the model's limit (128) cuts"


def test_skiplist_and_prompts_shape_the_vectors(model_a, engines):
    """Documents lose their skiplist tokens, queries keep them; the prompts' tokens are returned."""
    engine = engines(model_a[0])
    text = "the (the) the"
    query, document = (engine.embed([text], _params(task)).multi_vectors[0] for task in ("query", "document"))
    # [CLS] query : the ( the ) the [SEP] = 9 tokens, expanded to 12; [CLS] passage : the ( the ) the [SEP]
    # keeps [CLS] passage : [SEP] once the skiplist drops the, ( and ).
    assert len(query) == 12
    assert len(document) == 4


def test_rerank_equals_the_library_maxsim(model_a, engines, sample):
    from embedserv.types import RerankParams

    model_dir, reference = model_a
    query, documents = sample[9], sample[:9] + sample[10:]
    expected = reference.similarity(reference.encode_query([query]), reference.encode_document(documents))[0].numpy()

    result = engines(model_dir).rerank(query, documents, RerankParams(truncate=True))

    order = [r.index for r in result.results]
    assert order == np.argsort(-expected, kind="stable").tolist()
    scores = np.array([r.score for r in sorted(result.results, key=lambda r: r.index)])
    np.testing.assert_allclose(scores, expected, atol=1e-4)
    top = engines(model_dir).rerank(query, documents, RerankParams(truncate=True, top_n=3)).results
    assert [r.index for r in top] == order[:3]


def test_model_info(model_a, engines):
    from embedserv.types import EmbedOutput, Task

    info = engines(model_a[0]).info
    assert info.tasks == (Task.EMBED_MULTI_VECTOR, Task.RERANK)
    assert info.outputs == (EmbedOutput.MULTI_VECTOR,)
    assert info.multi_vector_dimension == DIMENSION
    assert info.dimension == 0


def test_too_long_inputs_are_refused_without_truncate(model_a, engines, sample):
    from embedserv.errors import InvalidInput
    from embedserv.types import RerankParams

    engine, long_text = engines(model_a[0]), sample[0]
    with pytest.raises(InvalidInput, match="more than the 20 the model takes as a query"):
        engine.embed([long_text], _params("query"))
    with pytest.raises(InvalidInput, match="more than the 40 the model takes as a document"):
        engine.embed(["short", long_text], _params("document"))
    with pytest.raises(InvalidInput, match="queries are never truncated"):
        engine.rerank(long_text, ["a document"], RerankParams(truncate=True))


def _spec_error(model_dir) -> str:
    """The ConfigError start-up raises for a model directory."""
    from embedserv.config import ModelConfig
    from embedserv.errors import ConfigError
    from embedserv.models.loading.spec_reader import read_model_spec

    with pytest.raises(ConfigError) as error:
        read_model_spec(ModelConfig(path=str(model_dir), served_name="m"))
    return str(error.value)


def test_token_level_modules_without_the_multi_vector_type_are_refused(model_a, tmp_path):
    """Transformer, Dense, Normalize and no Pooling is a MultiVectorEncoder only when its config says so."""
    model_dir = model_a[0]
    modules = [m for m in read_json(model_dir / "modules.json") if not m["type"].endswith("MultiVectorMask")]
    st_config = read_json(model_dir / "config_sentence_transformers.json")
    for model_type in ("SentenceTransformer", None):
        edited = (
            dict(st_config, model_type=model_type)
            if model_type
            else {k: v for k, v in st_config.items() if k != "model_type"}
        )
        copy = edited_copy(
            model_dir,
            tmp_path / f"as-{model_type}",
            {
                "modules.json": modules,
                "config_sentence_transformers.json": edited,
            },
        )
        message = _spec_error(copy)
        assert "Transformer -> Dense -> Dense -> Normalize" in message and "SentenceTransformer" in message


BERT_CONFIG, ST_CONFIG = "sentence_bert_config.json", "config_sentence_transformers.json"
DENSE_CONFIG = "1_Dense/config.json"
# (file, changes to its JSON, what the start-up error says) per refused setting.
REFUSED = {
    "expansion-attend-false": (
        BERT_CONFIG,
        {"query_expansion": {"strategy": "fixed", "attend": False, "length": 16}},
        "attend false",
    ),
    "query-length-below-expansion": (BERT_CONFIG, {"query_length": 8}, "query_length 8 is below query_expansion"),
    "processing-kwargs": (BERT_CONFIG, {"processing_kwargs": {"text": {"padding": "max_length"}}}, "processing_kwargs"),
    "pylate-prefix": (ST_CONFIG, {"query_prefix": "[Q] "}, "PyLate-era settings"),
    "sentence-level-dense": (DENSE_CONFIG, {"module_input_name": "sentence_embedding"}, "write token_embeddings"),
    "residual-dense": (DENSE_CONFIG, {"use_residual": True}, "use_residual"),
}
# The same, for what only the tokenizer shows (refused when the engine is built).
REFUSED_WITH_TOKENIZER = {
    "unknown-expansion-token": (
        BERT_CONFIG,
        {"query_expansion": dict(MODEL_A["query_expansion"], token="zzqxw")},
        "not in the tokenizer's vocabulary",
    ),
    "min-expansion-left-padding": ("tokenizer_config.json", {"padding_side": "left"}, "left-padding tokenizer"),
}


def _edited(model_dir, tmp_path, name: str, changes: dict):
    return edited_copy(model_dir, tmp_path / "edited", {name: dict(read_json(model_dir / name), **changes)})


@pytest.mark.parametrize("case", REFUSED)
def test_settings_the_library_runs_differently_are_refused(case, model_a, tmp_path):
    name, changes, expected = REFUSED[case]
    assert expected in _spec_error(_edited(model_a[0], tmp_path, name, changes))


@pytest.mark.parametrize("case", REFUSED_WITH_TOKENIZER)
def test_tokenizer_settings_the_library_runs_differently_are_refused(case, model_a, tmp_path):
    from embedserv.config import ModelConfig
    from embedserv.engine.core.local_core import LocalCore
    from embedserv.errors import ConfigError

    name, changes, expected = REFUSED_WITH_TOKENIZER[case]
    model_dir = _edited(model_a[0], tmp_path, name, changes)
    with pytest.raises(ConfigError, match=expected):
        LocalCore.load(ModelConfig(path=str(model_dir), served_name="m"), warm_up=False)


def test_the_library_default_module_order_loads(model_root):
    from embedserv.config import ModelConfig
    from embedserv.models.loading.spec_reader import read_model_spec

    model_dir = build_multi_vector_encoder(model_root, mask_before_normalize=True)
    spec = read_model_spec(ModelConfig(path=str(model_dir), served_name="m"))
    assert spec.info.multi_vector_dimension == DIMENSION


def test_plain_embedder_token_vectors_are_its_last_hidden_states(bundled_dir, engines, sample):
    """A SentenceTransformer model's token vectors: every token's last hidden state, unnormalized."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    texts = sample[:4] + sample[8:]
    result = engines(bundled_dir).embed(texts, _params(None, truncate=True))

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_dir))
    model = AutoModel.from_pretrained(str(bundled_dir), attn_implementation="eager").eval()
    for index, text in enumerate(texts):
        inputs = tokenizer(text, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            expected = model(**inputs).last_hidden_state[0].numpy()
        assert result.multi_vectors[index].shape == expected.shape
        assert_cosine_at_least(result.multi_vectors[index], expected, MIN_COSINE, what=f"input {index}: ")
        np.testing.assert_allclose(
            np.linalg.norm(result.multi_vectors[index], axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4
        )


@pytest.mark.slow
@pytest.mark.parametrize("task", ["query", "document", "left-padded query"])
def test_fixed_expansion_meanmaxsim_and_allowlist_match_the_library(task, model_root, engines, sample, tmp_path):
    """Model B: no prompts, queries always 16 tokens ("fixed" expansion; with a left-padding tokenizer the
    expansion tokens come first), the skiplist on queries too, documents keep only a few ids (some none:
    they score -1e9), and MeanMaxSim scoring."""
    from embedserv.types import RerankParams
    from tests.helpers.models import _bundled_tokenizer

    keep = _bundled_tokenizer(128).convert_tokens_to_ids(["the", "a", "of", "is", "to"])
    model_dir = build_multi_vector_encoder(
        model_root,
        seed=1,
        skiplist_words=["the", "."],
        skiplist_tasks=["query", "document"],
        query_expansion={"strategy": "fixed", "attend": True, "length": 16},
        similarity_fn_name="meanmaxsim",
        keep_only_token_ids=keep,
    )
    if task == "left-padded query":
        model_dir = _edited(model_dir, tmp_path, "tokenizer_config.json", {"padding_side": "left"})
    reference = load_multi_vector_reference(model_dir)
    encode = reference.encode_document if task == "document" else reference.encode_query
    texts = [*sample, "", "zebra"]

    result = engines(model_dir).embed(texts, _params(task.split()[-1], truncate=True))

    _assert_same_vectors(result.multi_vectors, encode(texts, convert_to_numpy=True), texts, f"task {task}")
    if task == "document":
        assert min(len(v) for v in result.multi_vectors) == 0
        expected = reference.similarity(reference.encode_query([sample[8]]), reference.encode_document(texts))[0]
        ranked = engines(model_dir).rerank(sample[8], texts, RerankParams(truncate=True)).results
        scores = np.array([r.score for r in sorted(ranked, key=lambda r: r.index)])
        np.testing.assert_allclose(scores, expected.numpy(), rtol=1e-5, atol=1e-4)
