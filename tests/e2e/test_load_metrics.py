"""The load gauges on /metrics under a held load: the workers' model threads are held at a gate, so calls pile up;
waiting calls and tokens rise while the worker is busy, running calls and the busy ratio are above 0, and all of
it goes back to 0 once the gate opens and the calls end. The vllm: aliases the Gateway API Inference Extension's
endpoint picker reads equal our own names; the generating model shows its KV cache in use; the --lora model
lists its adapters."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from embedserv.executor.local_worker import LocalWorker
from tests.helpers.client import RPC_TIMEOUT_S, embed_request, inference_stub
from tests.helpers.inprocess import in_process_server
from tests.helpers.lora_models import BERT_TARGETS, build_adapter
from tests.helpers.metrics import Scrape, scrape
from tests.helpers.models import build_tiny_encoder
from tests.helpers.processes import wait_for
from tests.helpers.server import free_port

EMBEDDER, GEN = "encoder", "tiny-llama"
WAIT_S = 60.0
LOAD = ("embedserv_requests_waiting", "embedserv_requests_running", "embedserv_waiting_tokens")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_generator):
    """(stub, metrics port): a --lora encoder and a tiny Llama, in this process, one step in flight per worker."""
    root = tmp_path_factory.mktemp("load-metrics")
    encoder = build_tiny_encoder(root, "bert", "mean")
    adapter = build_adapter(encoder, root / "legal", 1, r=4, lora_alpha=4, target_modules=list(BERT_TARGETS))
    config = root / "config.yaml"
    config.write_text(
        f"models:\n  - path: {encoder}\n    served_name: {EMBEDDER}\n    lora: {{legal: {adapter}}}\n"
        f"  - path: {tiny_generator('llama')}\n    served_name: {GEN}\n"
    )
    metrics_port = free_port()
    args = [
        "--config", str(config), "--dtype", "float32", "--device", "cpu", "--pipeline-depth", "1",
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    with in_process_server(args) as (target, _), grpc.insecure_channel(target) as channel:
        yield inference_stub(channel), metrics_port


@pytest.fixture
def gate(monkeypatch):
    """Closed: every worker's next step waits on the model thread until the test opens it (always opened)."""
    opened = threading.Event()
    run = LocalWorker._run

    def held(self, prepared):
        opened.wait(WAIT_S)
        return run(self, prepared)

    monkeypatch.setattr(LocalWorker, "_run", held)
    yield opened
    opened.set()


def _until(port: int, predicate, what: str) -> Scrape:
    """The first scrape that satisfies `predicate`, polled."""

    def satisfied() -> Scrape | None:
        s = scrape(port)
        return s if predicate(s) else None

    return wait_for(satisfied, WAIT_S, 0.05, what)


def _load(s: Scrape, model: str) -> tuple[float, ...]:
    return tuple(s.value(name, model=model) for name in LOAD)


def _embed(stub, text: str, priority: int | None = None):
    metadata = () if priority is None else (("x-priority", str(priority)),)
    return stub.Embed(embed_request([text], model=EMBEDDER), metadata=metadata, timeout=RPC_TIMEOUT_S)


def test_idle_server_reads_zero_load_and_lists_its_adapters(server):
    _, port = server
    s = scrape(port)
    for model in (EMBEDDER, GEN):
        assert _load(s, model) == (0, 0, 0)
        assert s.value("vllm:num_requests_waiting", model_name=model) == 0
    assert s.value("vllm:kv_cache_usage_perc", model_name=EMBEDDER) == 0
    lora = [labels for (name, labels), v in s.samples.items() if name == "vllm:lora_requests_info" and v > 0]
    assert [dict(labels) for labels in lora] == [{
        "model_name": EMBEDDER, "max_lora": "1", "running_lora_adapters": "legal", "waiting_lora_adapters": "",
    }]  # fmt: skip
    config = [dict(labels) for (name, labels) in s.samples if name == "vllm:cache_config_info"]
    assert len(config) == 1 and config[0]["model_name"] == GEN
    assert int(config[0]["num_gpu_blocks"]) > 0 and int(config[0]["block_size"]) > 0


def test_embed_calls_wait_while_the_worker_is_busy_then_drain(server, gate):
    stub, port = server
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(_embed, stub, "the first call holds the worker")
        _until(port, lambda s: s.value("embedserv_requests_running", model=EMBEDDER) == 1, "the first call to run")
        # Two of the three waiting calls at priority 5: the per-priority gauges split them.
        rest = [
            pool.submit(_embed, stub, f"call {i} waits for the worker with a few words", i or None) for i in (0, 5, 5)
        ]
        held = _until(port, lambda s: s.value("embedserv_requests_waiting", model=EMBEDDER) == 3, "three calls waiting")
        assert held.value("embedserv_requests_running", model=EMBEDDER) == 1
        assert held.value("embedserv_waiting_tokens", model=EMBEDDER) >= 3 * 8
        assert held.value("embedserv_worker_busy_ratio", model=EMBEDDER) > 0
        assert held.value("embedserv_worker_busy_ratio", model=GEN) == 0
        assert held.value("vllm:num_requests_waiting", model_name=EMBEDDER) == 3
        assert held.value("vllm:num_requests_running", model_name=EMBEDDER) == 1
        by_class = dict(model=EMBEDDER, tenant="")
        assert held.value("embedserv_sequences_waiting", priority="5", **by_class) == 2
        assert held.value("embedserv_sequences_waiting", priority="0", **by_class) == 1
        assert held.value("embedserv_sequences_running", priority="0", **by_class) == 1
        gate.set()
        for call in [first, *rest]:
            assert len(call.result(RPC_TIMEOUT_S).embeddings) == 1
    after = _until(port, lambda s: _load(s, EMBEDDER) == (0, 0, 0), "the load to drain")
    assert after.value("vllm:num_requests_waiting", model_name=EMBEDDER) == 0
    assert after.value("vllm:num_requests_running", model_name=EMBEDDER) == 0


def _generate(stub, prompt: str) -> list:
    from embedserv.v1 import embedserv_pb2 as pb

    request = pb.GenerateRequest(model=GEN, prompt=prompt, max_tokens=3, ignore_eos=True)
    return list(stub.Generate(request, timeout=RPC_TIMEOUT_S))


def test_generation_streams_run_and_wait_with_their_kv_cache_in_use(server, gate):
    stub, port = server
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_generate, stub, "a stream that holds the worker")
        _until(port, lambda s: s.value("embedserv_requests_running", model=GEN) == 1, "the first stream to step")
        second = pool.submit(_generate, stub, "a stream that waits for the next step")
        held = _until(port, lambda s: s.value("embedserv_requests_waiting", model=GEN) == 1, "a stream waiting")
        assert held.value("embedserv_waiting_tokens", model=GEN) > 0
        usage = held.value("embedserv_kv_cache_usage_ratio", model=GEN)
        assert 0 < usage <= 1
        assert held.value("vllm:kv_cache_usage_perc", model_name=GEN) == usage
        assert held.value("embedserv_worker_busy_ratio", model=GEN) > 0
        assert held.value("vllm:num_requests_running", model_name=GEN) == 1
        assert held.value("vllm:num_requests_waiting", model_name=GEN) == 1
        gate.set()
        assert first.result(RPC_TIMEOUT_S) and second.result(RPC_TIMEOUT_S)
    after = _until(port, lambda s: _load(s, GEN) == (0, 0, 0), "the streams to end")
    assert after.value("vllm:kv_cache_usage_perc", model_name=GEN) == 0


def test_a_cancelled_waiting_call_stops_counting_while_the_worker_is_still_busy(server, gate):
    stub, port = server
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_embed, stub, "the call that holds the worker")
        _until(port, lambda s: s.value("embedserv_requests_running", model=EMBEDDER) == 1, "the first call to run")
        waiting = stub.Embed.future(embed_request(["a call that gives up"], model=EMBEDDER), timeout=RPC_TIMEOUT_S)
        _until(port, lambda s: s.value("embedserv_waiting_tokens", model=EMBEDDER) > 0, "the second call waiting")
        waiting.cancel()
        gone = _until(port, lambda s: _load(s, EMBEDDER) == (0, 1, 0), "the cancelled call to stop counting")
        assert gone.value("embedserv_worker_busy_ratio", model=EMBEDDER) > 0
        gate.set()
        assert len(first.result(RPC_TIMEOUT_S).embeddings) == 1
    _until(port, lambda s: _load(s, EMBEDDER) == (0, 0, 0), "the load to drain")
