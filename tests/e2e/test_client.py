"""embedserv-client against a live server: every RPC, sync and async, batch splitting, errors, the CLI.

One server serves the bundled all-MiniLM-L6-v2, a cross-encoder, a 3-label classifier and a tiny generator,
with --max-client-batch-size 4 so that ordinary calls are split. The client's answers are checked against
the raw generated stubs (whose own parity with the reference libraries the other e2e tests show), and the
embeddings once more against sentence-transformers. The metrics port shows how many requests a split call
made."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from embedserv_client import AsyncClient, Client, EmbedservError
from tests.helpers.client import response_matrix
from tests.helpers.client_drivers import driver
from tests.helpers.inprocess import in_process_server
from tests.helpers.metrics import scrape
from tests.helpers.scorers import every_task_models
from tests.helpers.server import free_port

EMBEDDER, CROSS, CLASSIFIER, GEN = "minilm", "cross", "classifier", "gen"
SERVER_BATCH = 4
TEXTS = [f"Sentence number {i} talks about {topic}." for i, topic in enumerate(
    ["cats", "the weather", "stock markets", "cooking pasta", "rivers", "old castles", "jazz", "trains", "tea", "rain"]
)]  # fmt: skip
RPC_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_dir):
    root = tmp_path_factory.mktemp("client-e2e")
    models = every_task_models(root, bundled_dir, (EMBEDDER, CROSS, CLASSIFIER, GEN))
    metrics_port = free_port()
    args = ["--dtype", "float32", "--device", "cpu", "--max-client-batch-size", str(SERVER_BATCH),
            "--kv-cache-memory", "64MiB", "--metrics-port", str(metrics_port)]  # fmt: skip
    for name, path in models.items():
        args += ["--model", str(path), "--served-model-name", name]
    with in_process_server(args) as (target, _proc):
        yield target, metrics_port


@pytest.fixture(scope="module")
def target(server) -> str:
    return server[0]


@pytest.fixture(params=["sync", "async"])
def client(request, target):
    made = driver(request.param, target, model=EMBEDDER, timeout=RPC_TIMEOUT_S)
    yield made
    made.close()


def ok_calls(metrics_port: int, rpc: str) -> float:
    return scrape(metrics_port).total("embedserv_requests_total", rpc=rpc, status="OK")


# --- embed ------------------------------------------------------------------------------------------------


def test_embed_equals_the_stub_and_sentence_transformers(client, stub, pb, bundled_reference):
    matrix = client.embed(TEXTS[:3])
    raw = response_matrix(stub.Embed(pb.EmbedRequest(model=EMBEDDER, inputs=TEXTS[:3]), timeout=RPC_TIMEOUT_S))
    assert matrix.dtype == np.float32 and matrix.shape == (3, 384)
    np.testing.assert_array_equal(matrix, raw)  # ENCODING_BYTES carries the same float32s as ENCODING_FLOAT
    expected = bundled_reference.encode(TEXTS[:3], convert_to_numpy=True, normalize_embeddings=True)
    cosines = (matrix * expected).sum(axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() >= 0.9999


def test_embed_one_string_gives_one_vector_and_options_pass_through(client, stub, pb):
    vector = client.embed(TEXTS[0], dimensions=16, normalize=False)
    request = pb.EmbedRequest(model=EMBEDDER, inputs=[TEXTS[0]], dimensions=16, normalize=False)
    assert vector.shape == (16,)
    np.testing.assert_array_equal(vector, response_matrix(stub.Embed(request, timeout=RPC_TIMEOUT_S))[0])
    assert abs(float(np.linalg.norm(vector)) - 1.0) > 1e-3  # not normalized


def test_embed_splits_a_large_batch_into_server_sized_requests(client, server):
    _target, metrics_port = server
    one_by_one = np.stack([client.embed(text) for text in TEXTS])
    before = ok_calls(metrics_port, "Embed")
    matrix = client.embed(TEXTS)
    # 10 texts at 4 per request: 3 requests, answered in order.
    assert ok_calls(metrics_port, "Embed") - before == 3
    np.testing.assert_allclose(matrix, one_by_one, atol=1e-6)


def test_a_batch_size_past_the_servers_limit_is_refused_with_the_flag_named(target):
    too_big = driver("sync", target, model=EMBEDDER, batch_size=SERVER_BATCH + 1)
    with pytest.raises(EmbedservError) as caught:
        too_big.embed(TEXTS[: SERVER_BATCH + 1])
    too_big.close()
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-client-batch-size" in caught.value.details
    assert caught.value.request_id


def test_embed_stream_answers_each_batch_in_order(client):
    batches = [TEXTS[0:2], TEXTS[2:5], TEXTS[5:6]]
    matrices = client.embed_stream(batches)
    assert [m.shape for m in matrices] == [(2, 384), (3, 384), (1, 384)]
    np.testing.assert_allclose(np.concatenate(matrices), client.embed(TEXTS[:6]), atol=1e-6)


# --- rerank, classify, tokenize, generate -----------------------------------------------------------------


def test_rerank_split_and_merged_equals_each_document_scored_alone(client, stub, pb, server):
    alone = [
        stub.Rerank(pb.RerankRequest(model=CROSS, query="weather", documents=[doc]), timeout=RPC_TIMEOUT_S)
        .results[0]
        .score
        for doc in TEXTS
    ]
    before = ok_calls(server[1], "Rerank")
    results = client.rerank("weather", TEXTS, model=CROSS, top_n=5, return_documents=True)
    assert ok_calls(server[1], "Rerank") - before == 3
    best = sorted(range(len(TEXTS)), key=lambda i: -alone[i])[:5]
    assert [r.index for r in results] == best
    assert [r.document for r in results] == [TEXTS[i] for i in best]
    np.testing.assert_allclose([r.score for r in results], [alone[i] for i in best], atol=1e-5)
    everything = client.rerank("weather", TEXTS, model=CROSS)
    assert sorted(r.index for r in everything) == list(range(len(TEXTS)))
    assert all(r.document is None for r in everything)


def test_classify_equals_the_stub_and_one_string_gives_one(client, stub, pb):
    results = client.classify(TEXTS[:6], model=CLASSIFIER)
    replies = [stub.Classify(pb.ClassifyRequest(model=CLASSIFIER, inputs=TEXTS[i : i + 3]), timeout=RPC_TIMEOUT_S)
               for i in (0, 3)]  # fmt: skip
    expected = [c for reply in replies for c in reply.classifications]
    assert len(results) == 6
    for got, want in zip(results, expected, strict=True):
        assert got.label == want.label
        assert got.score == pytest.approx(want.score, abs=1e-5)
        assert list(got.scores) == [s.label for s in want.scores]
        np.testing.assert_allclose(list(got.scores.values()), [s.score for s in want.scores], atol=1e-5)
    single = client.classify(TEXTS[0], model=CLASSIFIER, raw_scores=True)
    assert single.label == results[0].label and single.score != pytest.approx(results[0].score)


def test_tokenize_equals_the_stub(client, stub, pb):
    tokenized = client.tokenize(TEXTS[:6])
    reply = stub.Tokenize(pb.TokenizeRequest(model=EMBEDDER, inputs=TEXTS[5:6]), timeout=RPC_TIMEOUT_S)
    assert len(tokenized) == 6
    assert [t.id for t in tokenized[5]] == [t.id for t in reply.inputs[0].tokens]
    assert tokenized[5][0].special and tokenized[5][0].text == "[CLS]"
    bare = client.tokenize("hello", add_special_tokens=False)
    assert [t.text for t in bare] == ["hello"] and bare[0].end == 5


def test_generate_streams_the_stubs_text_with_finish_reason_and_usage(client, stub, pb):
    request = pb.GenerateRequest(model=GEN, prompt="The river", max_tokens=12, ignore_eos=True)
    replies = list(stub.Generate(request, timeout=RPC_TIMEOUT_S))
    generated = client.generate("The river", model=GEN, max_tokens=12, ignore_eos=True)
    assert generated.text == "".join(r.text for r in replies)
    assert generated.token_ids == [t for r in replies for t in r.token_ids]
    assert generated.finish_reason == "length"
    assert generated.usage.completion_tokens == 12 and generated.usage.prompt_tokens == replies[-1].usage.prompt_tokens
    assert len(generated.pieces) > 1  # streamed, not one blob


def test_a_cancelled_generate_stream_stops_and_frees_its_kv_cache(target):
    with Client(target, model=GEN) as client:
        with client.generate("The river", max_tokens=200, ignore_eos=True) as stream:
            pieces = iter(stream)
            next(pieces)
            stream.cancel()
            with pytest.raises(EmbedservError) as caught:
                list(pieces)
        assert caught.value.code == grpc.StatusCode.CANCELLED
        assert stream.finish_reason is None
        wait_until(lambda: client.models()[3].kv_cache.used_blocks == 0)

    async def cancel_async():
        async with AsyncClient(target, model=GEN) as client:
            stream = client.generate("The river", max_tokens=200, ignore_eos=True)
            async for _ in stream:
                stream.cancel()
            return stream

    with pytest.raises(EmbedservError) as caught:
        asyncio.run(cancel_async())
    assert caught.value.code == grpc.StatusCode.CANCELLED
    with Client(target) as client:
        wait_until(lambda: client.models()[3].kv_cache.used_blocks == 0)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_models_limits_and_health(client):
    models = {m.name: m for m in client.models()}
    assert list(models) == [EMBEDDER, CROSS, CLASSIFIER, GEN]
    assert models[EMBEDDER].dimension == 384 and "embed" in models[EMBEDDER].tasks
    assert models[CLASSIFIER].labels and len(models[CLASSIFIER].labels) == 3
    assert "generate" in models[GEN].tasks and models[GEN].kv_cache is not None
    limits = client.limits()
    assert limits.max_client_batch_size == SERVER_BATCH and limits.max_input_chars == 100_000
    assert client.health() == "SERVING"
    assert client.health(GEN) == "SERVING"


def test_an_unknown_model_is_not_found_and_not_retried(client, server):
    before = scrape(server[1]).total("embedserv_requests_total", rpc="Embed", status="NOT_FOUND")
    with pytest.raises(EmbedservError) as caught:
        client.embed(["x"], model="nope")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert "nope" in caught.value.details and caught.value.request_id
    assert scrape(server[1]).total("embedserv_requests_total", rpc="Embed", status="NOT_FOUND") - before == 1


# --- the CLI ----------------------------------------------------------------------------------------------


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "embedserv_client.cli", *args],
        capture_output=True, text=True, timeout=120, input=stdin,
    )  # fmt: skip


def test_cli_embed_prints_json_embeddings(target):
    done = _cli("--target", target, "--model", EMBEDDER, "embed", TEXTS[0], TEXTS[1])
    assert done.returncode == 0, done.stderr
    printed = np.asarray(json.loads(done.stdout)["embeddings"], dtype=np.float32)
    np.testing.assert_array_equal(printed, driver("sync", target, model=EMBEDDER).embed(TEXTS[:2]))
    from_stdin = _cli("--target", target, "embed", stdin=f"{TEXTS[0]}\n{TEXTS[1]}\n")
    assert json.loads(from_stdin.stdout)["embeddings"] == json.loads(done.stdout)["embeddings"]
    assert "encoding_scale" not in json.loads(done.stdout)


@pytest.mark.parametrize("encoding", ["int8", "uint8_per_dimension"])
def test_cli_embed_prints_integer_encodings_and_their_scale(target, encoding):
    done = _cli("--target", target, "--model", EMBEDDER, "embed", "--encoding", encoding, TEXTS[0], TEXTS[1])
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    expected = driver("sync", target, model=EMBEDDER).embed(TEXTS[:2], encoding=encoding, outputs=["dense"])
    assert printed["embeddings"] == expected.dense.tolist()
    assert printed.get("encoding_scale", 0.0) == expected.encoding_scale
    assert (expected.encoding_scale > 0) == (encoding == "int8")


def test_cli_rerank_generate_models_and_health(target):
    rerank = json.loads(_cli("--target", target, "--model", CROSS, "rerank", "weather", *TEXTS[:3]).stdout)
    assert sorted(r["index"] for r in rerank["results"]) == [0, 1, 2]
    assert all(r["document"] == TEXTS[r["index"]] for r in rerank["results"])
    generated = json.loads(_cli("--target", target, "--model", GEN, "generate", "Hi", "--max-tokens", "3").stdout)
    assert generated["usage"]["completion_tokens"] <= 3 and generated["finish_reason"] in ("length", "eos")
    models = json.loads(_cli("--target", target, "models").stdout)
    assert [m["name"] for m in models["models"]] == [EMBEDDER, CROSS, CLASSIFIER, GEN]
    assert models["limits"]["max_client_batch_size"] == SERVER_BATCH
    health = _cli("--target", target, "health")
    assert (health.returncode, json.loads(health.stdout)) == (0, {"status": "SERVING"})


def test_cli_errors_exit_1_with_the_servers_message(target):
    done = _cli("--target", target, "--model", "nope", "embed", "x")
    assert done.returncode == 1 and done.stdout == ""
    assert "NOT_FOUND" in done.stderr and "nope" in done.stderr
    unknown_service = _cli("--target", target, "health", "--service", "nope")
    assert unknown_service.returncode == 1 and "NOT_FOUND" in unknown_service.stderr
