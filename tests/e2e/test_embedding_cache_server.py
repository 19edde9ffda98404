"""The embedding cache through the server's faces (--embedding-cache): a hit sends the bytes the miss sent
(gRPC raw bytes of dense and token vectors, the sparse message), bypass_cache over gRPC, HTTP, the Python
client and its CLI neither reads nor fills it, and /metrics counts hits, misses, evictions, bytes and entries.

One sequence per batch (--max-batch-requests 1): an output then does not depend on the batch it ran in, so a
cached answer and one computed again (bypassing the cache) compare bit for bit.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from embedserv_client import Client
from embedserv_client import cli as client_cli
from tests.helpers.client import RPC_TIMEOUT_S, inference_stub
from tests.helpers.inprocess import in_process_server
from tests.helpers.metrics import scrape
from tests.helpers.server import free_port, running_server
from tests.helpers.sparse_models import build_bge_m3

MODEL = "m3"
CACHE_BYTES = 64 * 2**10
COUNTERS = ("hits", "misses", "evictions")
GAUGES = ("bytes", "entries", "capacity_bytes")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_bge_m3(tmp_path_factory.mktemp("cache-server"), head_format="safetensors")
    metrics_port, http_port = free_port(), free_port()
    args = [
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--embedding-cache",
        "64KiB",
        "--attention-backend",
        "sdpa",
        "--max-batch-requests",
        "1",
        "--metrics-port",
        str(metrics_port),
        "--http-port",
        str(http_port),
    ]
    with in_process_server(args) as (target, _):
        yield target, metrics_port, f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server[0]) as channel:
        yield inference_stub(channel)


@pytest.fixture(scope="module")
def pb():
    from embedserv.v1 import embedserv_pb2

    return embedserv_pb2


def cache_metrics(server) -> dict[str, float]:
    got = scrape(server[1])
    values = {name: got.value(f"embedserv_embedding_cache_{name}_total", model=MODEL) for name in COUNTERS}
    values.update({name: got.value(f"embedserv_embedding_cache_{name}", model=MODEL) for name in GAUGES})
    return values


def moved(before: dict, after: dict) -> dict:
    return {name: after[name] - before[name] for name in (*COUNTERS, "entries")}


def outputs_bytes(reply) -> bytes:
    """What an EmbedResponse carries but its timing: dense raw bytes, sparse vectors, token vectors' raw bytes."""
    reply.ClearField("timing")
    return reply.SerializeToString(deterministic=True)


def embed(stub, pb, texts: list[str], **fields):
    wanted = {"encoding": pb.ENCODING_BYTES, "outputs": [pb.OUTPUT_DENSE, pb.OUTPUT_SPARSE, pb.OUTPUT_MULTI_VECTOR]}
    request = pb.EmbedRequest(model=MODEL, inputs=texts, **{**wanted, **fields})
    return stub.Embed(request, timeout=RPC_TIMEOUT_S)


def test_a_hit_sends_the_bytes_the_miss_sent(server, stub, pb):
    texts = ["a hit sends the bytes", "the miss sent", "a hit sends the bytes"]
    before = cache_metrics(server)
    miss = embed(stub, pb, texts)
    after_miss = cache_metrics(server)
    hit = embed(stub, pb, texts)
    after_hit = cache_metrics(server)
    computed = embed(stub, pb, texts, bypass_cache=True)

    assert moved(before, after_miss) == {"hits": 1, "misses": 2, "evictions": 0, "entries": 2}
    assert moved(after_miss, after_hit) == {"hits": 3, "misses": 0, "evictions": 0, "entries": 0}
    assert cache_metrics(server) == after_hit, "a bypassing call moved the cache"
    assert hit.timing.inference_us == 0 and hit.timing.queue_us == 0 and hit.usage.prompt_tokens > 0
    assert outputs_bytes(hit) == outputs_bytes(miss) == outputs_bytes(computed)
    assert hit.embeddings[0].raw == hit.embeddings[2].raw and hit.embeddings[0].raw != hit.embeddings[1].raw


def test_options_after_the_forward_pass_apply_to_a_hit(server, stub, pb):
    texts = ["options after the forward pass"]
    embed(stub, pb, texts)
    for fields in ({"dimensions": 8}, {"normalize": False}, {"sparse_top_k": 2}, {"encoding": pb.ENCODING_INT8}):
        hit = embed(stub, pb, texts, **fields)
        assert hit.timing.inference_us == 0, fields
        assert outputs_bytes(hit) == outputs_bytes(embed(stub, pb, texts, bypass_cache=True, **fields)), fields


def test_http_client_and_cli_bypass(server, capsys):
    target, _, http = server
    text = "bypassed by every face"
    before = cache_metrics(server)
    body = {"model": MODEL, "input": [text], "bypass_cache": True}
    assert httpx.post(f"{http}/v1/embeddings", json=body, timeout=RPC_TIMEOUT_S).status_code == 200
    with Client(target, model=MODEL, timeout=RPC_TIMEOUT_S) as client:
        bypassed = client.embed(text, bypass_cache=True)
        assert client_cli.main(["--target", target, "--model", MODEL, "embed", "--bypass-cache", text]) == 0
        assert json.loads(capsys.readouterr().out)["embeddings"][0] == bypassed.tolist()
        assert cache_metrics(server) == before
        cached = client.embed(text)
    del body["bypass_cache"]
    assert httpx.post(f"{http}/v1/embeddings", json=body, timeout=RPC_TIMEOUT_S).status_code == 200
    assert moved(before, cache_metrics(server)) == {"hits": 1, "misses": 1, "evictions": 0, "entries": 1}
    assert cached.tobytes() == bypassed.tobytes()


def test_the_cache_stays_within_its_size_and_counts_evictions(server, stub, pb):
    # A bge-m3 entry holds 64 floats dense, ~10 token vectors of 64 floats and a sparse pair: about 3 KiB.
    embed(stub, pb, [f"filler text number {i} with a few more words" for i in range(40)])
    metrics = cache_metrics(server)
    assert metrics["evictions"] > 0 and metrics["capacity_bytes"] == CACHE_BYTES
    assert 0 < metrics["bytes"] <= CACHE_BYTES and metrics["entries"] > 0


def test_front_end_processes_share_the_engine_process_cache(bundled_dir, pb):
    """--frontends 2: calls over many connections (both front ends, most likely) fill and hit one cache, in
    the engine process; bypass_cache crosses the link."""
    metrics_port = free_port()
    args = ["--model", str(bundled_dir), "--served-model-name", "minilm", "--dtype", "float32", "--frontends", "2",
            "--embedding-cache", "16MiB", "--max-batch-requests", "1", "--metrics-port", str(metrics_port)]  # fmt: skip
    request = pb.EmbedRequest(model="minilm", inputs=["shared by the front ends"], encoding=pb.ENCODING_BYTES)
    with running_server(args) as (target, _):
        replies = []
        for bypass in [False] * 6 + [True]:
            # Its own connection each: the kernel picks a front end for it.
            with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                request.bypass_cache = bypass
                replies.append(inference_stub(channel).Embed(request, timeout=RPC_TIMEOUT_S))
        got = scrape(metrics_port)
    counts = {name: got.value(f"embedserv_embedding_cache_{name}_total", model="minilm") for name in COUNTERS}
    assert counts == {"hits": 5, "misses": 1, "evictions": 0}
    assert got.value("embedserv_embedding_cache_entries", model="minilm") == 1
    assert len({reply.embeddings[0].raw for reply in replies}) == 1
    assert all(reply.timing.inference_us == 0 for reply in replies[1:6]) and replies[6].timing.inference_us > 0
