"""jina-embeddings-v3 (models/families/jina_v3.py): per-request task adapters equal transformers with that
adapter merged, on tiny random-weight models (tests/helpers/jina_models.py).

The engine serves the published form (xlm-roberta config, `parametrizations` tensor names, adapters); the
references are sentence-transformers over transformers' JinaEmbeddingsV3Model with the base weights (no
task) or one task's adapter merged into them (`W + alpha / rank * B A`), fed the task's instruction.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.helpers.compare import assert_cosine_at_least, cosines
from tests.helpers.jina_models import INSTRUCTIONS, TASKS, build_jina
from tests.helpers.models import load_reference

MIN_COSINE = 0.9999


def _params(**kwargs):
    from embedserv.types import EmbedParams

    return EmbedParams(truncate=True, **kwargs)


@pytest.fixture(scope="module")
def jina(tmp_path_factory):
    """pooling -> the model's directories (built once per module)."""
    built = {}

    def get(pooling: str) -> dict:
        if pooling not in built:
            built[pooling] = build_jina(tmp_path_factory.mktemp("jina"), pooling)
        return built[pooling]

    return get


def _reference(model_dir, texts, task=None) -> np.ndarray:
    prompt = INSTRUCTIONS[task] if task else None
    return load_reference(model_dir).encode(texts, prompt=prompt, convert_to_numpy=True, normalize_embeddings=True)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_each_task_equals_transformers_with_its_adapter(pooling, jina, engine_for, texts):
    dirs = jina(pooling)
    engine = engine_for(dirs["published"])
    assert engine.info.task_adapters == TASKS
    base = _reference(dirs["native"], texts)

    assert_cosine_at_least(engine.embed(texts, _params()).embeddings, base, MIN_COSINE, texts, what="no task: ")
    for task in TASKS:
        expected = _reference(dirs["merged"][task], texts, task)
        got = engine.embed(texts, _params(task=task)).embeddings
        assert_cosine_at_least(got, expected, MIN_COSINE, texts, what=f"{pooling}/{task}: ")
        # The adapters must matter, or the comparison above would say nothing.
        assert cosines(got, base).min() < 0.99, f"{task}: the adapter did not change the embeddings"


def test_prompt_name_of_a_task_picks_its_adapter_and_prompt(jina, engine_for, texts):
    engine = engine_for(jina("mean")["published"])
    for task in ("retrieval.query", "text-matching"):
        by_task = engine.embed(texts, _params(task=task)).embeddings
        by_prompt = engine.embed(texts, _params(prompt_name=task)).embeddings
        np.testing.assert_allclose(by_prompt, by_task, atol=1e-6)
    # An explicit prompt_name beside the task: that prompt, the task's adapter.
    query_prompt_on_passages = engine.embed(texts, _params(task="retrieval.passage", prompt_name="retrieval.query"))
    expected = load_reference(jina("mean")["merged"]["retrieval.passage"]).encode(
        texts, prompt=INSTRUCTIONS["retrieval.query"], convert_to_numpy=True, normalize_embeddings=True
    )
    assert_cosine_at_least(query_prompt_on_passages.embeddings, expected, MIN_COSINE, texts)


def test_a_step_mixing_tasks_equals_the_texts_run_task_by_task(jina, texts, monkeypatch):
    """One step holds sequences of four tasks and none (the worker's own step, built here so that the mix is
    certain): each row equals its sequence run in a step of its own task."""
    from transformers import AutoTokenizer

    from embedserv.config import ModelConfig
    from embedserv.models.families import jina_v3
    from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
    from tests.helpers.models import load_in_process

    model_dir = jina("mean")["published"]
    runner = load_in_process(ModelConfig(path=str(model_dir), served_name="m", dtype="float32"))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tuple(tokenizer(t, truncation=True, max_length=128)["input_ids"]) for t in texts[:12]]
    adapters = [(-1, 0, 2, 4)[i % 4] for i in range(len(ids))]

    def step(indexes):
        seqs = tuple(ScheduledSequence(i, ids[i], OutputKind.POOL, adapter=adapters[i]) for i in indexes)
        return runner.execute(StepBatch(seqs)).rows

    alone = np.concatenate([step([i]) for i in range(len(ids))])
    seen = []
    routes_of = jina_v3.routes_of
    monkeypatch.setattr(jina_v3, "routes_of", lambda *args: seen.append(routes_of(*args)) or seen[-1])
    mixed = step(range(len(ids)))

    assert [routes.adapters.tolist() for routes in seen] == [[0, 2, 4]], "the step did not run three tasks"
    np.testing.assert_allclose(mixed, alone, rtol=1e-4, atol=1e-5)


def test_concurrent_calls_of_different_tasks_equal_each_call_alone(jina, engine_for, texts):
    engine = engine_for(jina("mean")["published"])
    calls = [(texts[i::4], task) for i, task in enumerate(("retrieval.query", None, "separation", "text-matching"))]
    alone = [engine.embed(part, _params(task=task)).embeddings for part, task in calls]

    async def together():
        return await asyncio.gather(*(engine.engine.embedding.embed(part, _params(task=task)) for part, task in calls))

    for (part, task), result, expected in zip(calls, engine._call(together()), alone, strict=True):
        assert_cosine_at_least(result.embeddings, expected, 0.99999, part, what=f"{task} beside other tasks: ")


def test_bad_tasks_are_refused_naming_the_model_tasks(jina, engine_for):
    from embedserv.errors import InvalidInput

    dirs = jina("mean")
    with pytest.raises(InvalidInput, match=r"unknown task 'retrieval'.*retrieval\.query, retrieval\.passage"):
        engine_for(dirs["published"]).embed(["a"], _params(task="retrieval"))
    with pytest.raises(InvalidInput, match="has no task adapters"):
        engine_for(dirs["native"]).embed(["a"], _params(task="retrieval.query"))
    with pytest.raises(InvalidInput, match="unknown prompt_name"):
        engine_for(dirs["published"]).embed(["a"], _params(prompt_name="nope"))


def test_the_published_form_equals_the_native_form(jina, engine_for, texts):
    from embedserv.models.families.jina_v3 import published_config

    dirs = jina("mean")
    native = engine_for(dirs["native"]).embed(texts, _params()).embeddings
    published = engine_for(dirs["published"]).embed(texts, _params()).embeddings
    assert_cosine_at_least(published, native, 0.999999, texts, what="published vs native: ")
    assert engine_for(dirs["native"]).info.task_adapters == ()
    # A plain XLM-RoBERTa config is left to AutoConfig (the bert family).
    assert published_config({"model_type": "xlm-roberta", "position_embedding_type": "absolute"}) is None


def test_the_published_modules_json_with_its_custom_transformer_loads_without_running_it(
    jina, engine_for, texts, tmp_path
):
    """jinaai/jina-embeddings-v3's modules.json names custom_st.Transformer (a wrapper that passes the task
    on); it is read as Transformer and its file is never imported."""
    import json
    import shutil

    published = jina("mean")["published"]
    model_dir = tmp_path / "published-modules"
    shutil.copytree(published, model_dir)
    marker = tmp_path / "imported"
    (model_dir / "custom_st.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    modules = json.loads((model_dir / "modules.json").read_text())
    modules[0] = {**modules[0], "type": "custom_st.Transformer", "kwargs": ["task"]}
    (model_dir / "modules.json").write_text(json.dumps(modules))

    got = engine_for(model_dir).embed(texts, _params(task="retrieval.query")).embeddings
    expected = engine_for(published).embed(texts, _params(task="retrieval.query")).embeddings

    assert_cosine_at_least(got, expected, 0.999999, texts)
    assert not marker.exists(), "serving the model imported its custom_st.py"


@pytest.mark.parametrize("backend", ["naive", pytest.param("flex", marks=pytest.mark.slow)])
def test_other_backends_equal_sdpa_with_adapters(backend, jina, engine_for, texts):
    model_dir = jina("mean")["published"]
    other = engine_for(model_dir, attention_backend=backend, max_batch_tokens=256)
    assert other.info.attention_backend == backend
    for task in (None, "retrieval.passage"):
        sdpa = engine_for(model_dir).embed(texts, _params(task=task)).embeddings
        got = other.embed(texts, _params(task=task)).embeddings
        assert_cosine_at_least(got, sdpa, 0.99999, texts, what=f"{backend}/{task} vs sdpa: ")


def test_int8_stays_close_to_float32_with_adapters(jina, engine_for, texts):
    model_dir = jina("mean")["published"]
    int8 = engine_for(model_dir, quantization="int8")
    for task in (None, "retrieval.query", "classification"):
        exact = engine_for(model_dir).embed(texts, _params(task=task)).embeddings
        got = int8.embed(texts, _params(task=task)).embeddings
        assert_cosine_at_least(got, exact, 0.99, texts, what=f"int8/{task}: ")


def test_the_task_reaches_the_model_through_grpc_and_http(jina, engine_for, texts):
    """EmbedRequest.task, /v1/embeddings' `task` and ListModels' adapters; a bad task is INVALID_ARGUMENT /
    400 naming the model's tasks."""
    import grpc
    import httpx

    from embedserv.v1 import embedserv_pb2 as pb
    from tests.helpers.client import embed_request, inference_stub, response_matrix
    from tests.helpers.inprocess import in_process_server
    from tests.helpers.server import free_port

    model_dir = jina("mean")["published"]
    sample = texts[:6]
    expected = engine_for(model_dir).embed(sample, _params(task="retrieval.query")).embeddings
    http_port = free_port()
    args = ["--model", str(model_dir), "--served-model-name", "jina", "--dtype", "float32"]
    args += ["--http-port", str(http_port)]
    with in_process_server(args) as (target, _), grpc.insecure_channel(target) as channel:
        stub = inference_stub(channel)
        assert tuple(stub.ListModels(pb.ListModelsRequest()).models[0].adapters) == TASKS
        reply = stub.Embed(embed_request(sample, truncate=True, task="retrieval.query"))
        assert_cosine_at_least(response_matrix(reply), expected, 0.99999, sample, what="gRPC: ")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(embed_request(sample, truncate=True, task="query"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "retrieval.query, retrieval.passage" in refused.value.details()

        url = f"http://127.0.0.1:{http_port}/v1/embeddings"
        body = {"input": sample, "model": "jina", "truncate": True, "task": "retrieval.query"}
        reply = httpx.post(url, json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        got = np.array([row["embedding"] for row in reply.json()["data"]], dtype=np.float32)
        assert_cosine_at_least(got, expected, 0.99999, sample, what="HTTP: ")
        refused = httpx.post(url, json=body | {"task": "query"}, timeout=60)
        assert refused.status_code == 400 and "retrieval.query" in refused.text


def test_the_classifier_head_equals_transformers(tmp_path_factory, engine_for, texts):
    """JinaEmbeddingsV3ForSequenceClassification (the base weights: transformers' class has no adapters):
    raw logits and the sigmoid within 1e-4 of transformers, query/document pairs."""
    from embedserv.types import RerankParams
    from tests.helpers.jina_models import build_jina_cross_encoder
    from tests.helpers.scorers import classifier_reference

    model_dir = build_jina_cross_encoder(tmp_path_factory.mktemp("jina-ce"))
    query, documents = "read a gzip file", texts[:12]
    logits = classifier_reference(model_dir, None, pairs=[(query, d) for d in documents])[:, 0]
    assert logits.std() > 0.1, "the head must separate the documents"
    engine = engine_for(model_dir)
    for raw, expected in ((True, logits), (False, 1 / (1 + np.exp(-logits)))):
        result = engine.rerank(query, documents, RerankParams(truncate=True, raw_scores=raw))
        scores = np.zeros(len(documents), np.float32)
        for r in result.results:
            scores[r.index] = r.score
        np.testing.assert_allclose(scores, expected, atol=1e-4)


def test_windows_and_token_id_inputs_run_with_the_task(jina, engine_for, texts):
    """chunking embeds each window with the call's task; token-id inputs take the task's adapter (no prompt:
    they are used as given, so the check uses separation, whose prompt is empty)."""
    from transformers import AutoTokenizer

    from embedserv.types import EmbedParams

    model_dir = jina("mean")["published"]
    engine = engine_for(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    fits = [t for t in texts if len(tokenizer(t)["input_ids"]) <= 128][:8]
    long = [t for t in texts if len(tokenizer(t)["input_ids"]) > 128][:4]
    assert len(fits) == 8 and len(long) == 4

    whole = engine.embed(fits, EmbedParams(task="separation")).embeddings
    windows = engine.embed(fits + long, EmbedParams(task="separation", chunking=True)).embeddings
    assert_cosine_at_least(windows[:8], whole, 0.99999, fits, what="one window: ")
    base_windows = engine.embed(long, EmbedParams(chunking=True)).embeddings
    assert cosines(windows[8:], base_windows).max() < 0.99, "the windows ran without the task's adapter"

    ids = [tokenizer(t)["input_ids"] for t in fits]
    by_ids = engine._call(engine.engine.embedding.embed_token_ids(ids, EmbedParams(task="separation"))).embeddings
    assert_cosine_at_least(by_ids, whole, 0.99999, fits, what="token ids: ")
