"""`embedserv serve --frontends 2`: two front-end processes on one port in front of the engine process.

Admission, deadlines, drain, worker crashes and /metrics run with two front ends in their own files
(test_admission, test_deadlines, test_drain, test_workers); here is what only front-end processes do: a
generation stream through the link (token for token), its cancellation freeing the KV blocks in the engine,
calls over many connections counted once in /metrics, a front end that dies replaced, the front ends dying
with the engine process, and a port already served refused.
"""

from __future__ import annotations

import os
import signal

import grpc
import httpx
import pytest

from tests.helpers.client import embed_request, inference_stub, response_matrix
from tests.helpers.inprocess import serve_main
from tests.helpers.metrics import scrape
from tests.helpers.models import build_tiny_generator
from tests.helpers.processes import cmdline, frontend_pids, is_alive, session_id, wait_for, worker_pids, zygote_pids
from tests.helpers.server import free_port, running_server

GEN, EMBEDDER = "tiny-llama", "minilm"
PROMPT = "The quick brown fox jumps over the lazy dog"
RPC_TIMEOUT_S = 60.0


def _frontends(server_pid: int) -> list[int]:
    return frontend_pids(server_pid)


def _channel(target: str) -> grpc.Channel:
    # Its own connection (no subchannel shared with the other channels): the kernel picks its front end.
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture(scope="module")
def generator_dir(tmp_path_factory):
    return build_tiny_generator(tmp_path_factory.mktemp("frontends"), "llama", seed=5)


@pytest.fixture(scope="module")
def server(generator_dir, bundled_dir):
    metrics_port, http_port = free_port(), free_port()
    args = ["--dtype", "float32", "--model", str(generator_dir), "--served-model-name", GEN,
            "--model", str(bundled_dir), "--served-model-name", EMBEDDER, "--frontends", "2",
            "--metrics-port", str(metrics_port), "--http-port", str(http_port)]  # fmt: skip
    with running_server(args) as (target, proc):
        yield target, proc, metrics_port, http_port


def _used_blocks(metrics_port: int) -> float:
    return scrape(metrics_port).value("embedserv_kv_cache_blocks", model=GEN, state="used")


def _reference(model_dir, max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").float().eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_two_frontend_processes_serve_generation_token_for_token(server, generator_dir):
    from embedserv.v1 import embedserv_pb2 as pb

    target, proc, *_ = server
    assert len(_frontends(proc.pid)) == 2
    expected = _reference(generator_dir, 20)
    for _ in range(4):  # four connections: both front ends, most likely
        with _channel(target) as channel:
            request = pb.GenerateRequest(model=GEN, prompt=PROMPT, max_tokens=20, ignore_eos=True)
            stream = list(inference_stub(channel).Generate(request, timeout=RPC_TIMEOUT_S))
        assert [t for r in stream for t in r.token_ids] == expected
        assert stream[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_an_unstreamed_completion_through_a_frontend_equals_the_stream(server):
    """A front end asks the engine for an unstreamed completion whole (stream=False crosses the link): the text
    is the stream's."""
    from embedserv.v1 import embedserv_pb2 as pb

    target, _, _, http_port = server
    with _channel(target) as channel:
        request = pb.GenerateRequest(model=GEN, prompt=PROMPT, max_tokens=20, ignore_eos=True)
        streamed = "".join(r.text for r in inference_stub(channel).Generate(request, timeout=RPC_TIMEOUT_S))
    body = {"model": GEN, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=RPC_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (streamed, "length")
    assert reply.json()["usage"]["completion_tokens"] == 20


def test_a_stream_cancelled_at_its_frontend_frees_its_blocks_in_the_engine(server):
    from embedserv.v1 import embedserv_pb2 as pb

    target, _, metrics_port, _ = server
    assert _used_blocks(metrics_port) == 0
    with _channel(target) as channel:
        request = pb.GenerateRequest(model=GEN, prompt=PROMPT * 3, max_tokens=400, ignore_eos=True)
        call = inference_stub(channel).Generate(request, timeout=RPC_TIMEOUT_S)
        for _ in range(3):
            next(call)
        assert _used_blocks(metrics_port) > 0
        # The engine process counts the stream the front end relayed (the load gauges are read where it runs).
        assert scrape(metrics_port).value("vllm:num_requests_running", model_name=GEN) == 1
        call.cancel()
        wait_for(lambda: _used_blocks(metrics_port) == 0, 10, what="the cancelled stream's blocks freed")
        assert scrape(metrics_port).value("embedserv_requests_running", model=GEN) == 0
    cancelled = dict(protocol="grpc", rpc="Generate", model=GEN, status="CANCELLED")
    wait_for(lambda: scrape(metrics_port).value("embedserv_requests_total", **cancelled) == 1, 10,
             what="the cancelled call counted in the engine process's /metrics")  # fmt: skip


def test_calls_over_many_connections_are_counted_once_in_metrics(server):
    target, _, metrics_port, _ = server
    calls = dict(protocol="grpc", rpc="Embed", model=EMBEDDER, status="OK")
    before = scrape(metrics_port).value("embedserv_requests_total", **calls)
    for i in range(8):
        with _channel(target) as channel:
            rows = response_matrix(inference_stub(channel).Embed(embed_request([f"text {i}"], model=EMBEDDER),
                                                                 timeout=RPC_TIMEOUT_S))  # fmt: skip
            assert rows.shape == (1, 384)
    assert scrape(metrics_port).value("embedserv_requests_total", **calls) - before == 8
    assert scrape(metrics_port).value("embedserv_inputs_in_flight") == 0


def test_every_frontend_relays_the_engine_process_metrics_on_the_http_port(server):
    # The engine process builds the page; each front end (SO_REUSEPORT picks one per connection) relays it.
    http_port = server[3]
    for _ in range(6):
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=RPC_TIMEOUT_S) as http:
            page = http.get("/metrics")
        assert page.status_code == 200, page.text
        assert f'vllm:num_requests_waiting{{model_name="{EMBEDDER}"}}' in page.text
        assert "embedserv_requests_total" in page.text


def test_frontends_and_workers_are_forked_by_one_zygote(server):
    """Nothing imports twice: the server forks its zygote from itself (executor/zygote.py, fork_here), which forks
    the front ends and both models' workers; all are the server's children, each in a session of its own, and have
    its command line."""
    _target, proc, *_ = server
    (zygote,) = zygote_pids(proc.pid)
    frontends, workers = _frontends(proc.pid), worker_pids(proc.pid)
    assert len(frontends) == 2 and len(workers) == 2
    assert cmdline(zygote) == cmdline(proc.pid) and session_id(zygote) == zygote
    for pid in (*frontends, *workers):
        assert cmdline(pid) == cmdline(zygote) and session_id(pid) == pid


def test_a_frontend_that_dies_is_started_again(server):
    target, proc, *_ = server
    first, second = _frontends(proc.pid)
    os.kill(first, signal.SIGKILL)
    replaced = wait_for(lambda: len(set(_frontends(proc.pid)) - {first, second}) == 1 or None, 60,
                        what="a new front end")  # fmt: skip
    assert replaced
    for i in range(6):  # whichever front end each connection reaches answers
        with _channel(target) as channel:
            inference_stub(channel).Embed(embed_request([f"after {i}"], model=EMBEDDER), timeout=RPC_TIMEOUT_S)
    assert proc.poll() is None


def test_a_port_another_server_answers_on_is_refused(server, bundled_dir, monkeypatch, caplog):
    """The second server's engine host refuses the port before it loads a model or starts a front end: its
    `embedserv serve` runs in this process (cli.main), the first server in its own."""
    target, *_ = server
    port = target.rsplit(":", 1)[1]
    args = ["--model", str(bundled_dir), "--port", port, "--frontends", "2"]
    code, log = serve_main(args, monkeypatch, caplog)
    assert code == 2, log[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in log
    assert "pick another --port" in log


def test_sigkill_of_the_engine_process_takes_its_frontends_down(bundled_dir):
    with running_server(["--model", str(bundled_dir), "--frontends", "2", "--no-warm-up"]) as (_, proc):
        frontends = _frontends(proc.pid)
        assert len(frontends) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: not any(is_alive(pid) for pid in frontends), 30, what="the front ends gone")
