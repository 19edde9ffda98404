"""Fuzz every RPC with random field values: only documented status codes come back, and the server never dies.

One real server serves an embedder, a cross-encoder, a 3-label classifier and a generator, so each RPC meets
models that can answer it and models that cannot. Hypothesis draws requests with served, empty and random
model names; 0..10 random texts (empty ones, and ones past --max-input-chars); unknown enum values; optional
fields set or unset; numbers across their whole range (nan, inf, negative, huge). Every call must end OK or
with one of ALLOWED and a message; after each RPC's run the process is alive, health says SERVING and a plain
Embed works. A last test sends random calls of every RPC at once, some with deadlines that expire mid-call.
EMBEDSERV_FUZZ_EXAMPLES sets the examples per RPC (default 30) for a deeper fuzz by hand.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.client import inference_stub
from tests.helpers.fuzz_requests import (
    CHARS,
    CLASSIFIER,
    CROSS,
    EMBEDDER,
    GEN,
    MAX_CLIENT_BATCH,
    MAX_INPUT_CHARS,
    SERVED,
    classify_requests,
    embed_requests,
    generate_requests,
    list_models_requests,
    mostly,
    pb_module,
    rerank_requests,
    tokenize_requests,
)
from tests.helpers.inprocess import InProcessServer, in_process_server
from tests.helpers.scorers import every_task_models
from tests.helpers.server import health_status, log_tail

CALL_TIMEOUT_S = 30.0
EXAMPLES = int(os.environ.get("EMBEDSERV_FUZZ_EXAMPLES", "30"))

ALLOWED = frozenset(
    getattr(grpc.StatusCode, name)
    for name in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED")
)

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
    database=None,
)


# --- the server and the checks ------------------------------------------------------------------------------


@dataclass
class Served:
    target: str
    proc: InProcessServer
    stub: object
    outcomes: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def describe(self, what: str, request) -> str:
        """The failure, the request(s) as protobuf text, and the end of the server log."""
        requests = request if isinstance(request, list) else [request]
        shown = "\n".join(text_format.MessageToString(r, as_one_line=True)[:3000] for r in requests)
        return f"{what}\nrequest:\n{shown}\nserver log tail:\n{log_tail(self.proc.log_path, 3000)}"

    def attempt(self, send: Callable, request, timeout: float = CALL_TIMEOUT_S) -> None:
        """send(stub, request, timeout); an RpcError must carry an allowed status and a message."""
        try:
            send(self.stub, request, timeout)
        except grpc.RpcError as err:
            code = err.code()
            self._count(code.name)
            assert code in ALLOWED, self.describe(f"undocumented status {code.name}: {err.details()}", request)
            assert err.details(), self.describe(f"{code.name} without a message", request)
        else:
            self._count("OK")
        assert self.proc.poll() is None, self.describe(f"server exited with {self.proc.returncode}", request)

    def _count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def report(self) -> None:
        """Shown with -s: how much of the fuzz got past validation, which should be a fair share."""
        print(f"fuzz outcomes: {dict(self.outcomes)}")
        assert self.outcomes["OK"], f"no call was answered OK; the strategies never reach the model: {self.outcomes}"
        self.outcomes.clear()


@pytest.fixture(scope="module")
def served(tmp_path_factory, bundled_dir):
    root = tmp_path_factory.mktemp("e2e-fuzz")
    model_dirs = every_task_models(root, bundled_dir, (EMBEDDER, CROSS, CLASSIFIER, GEN))
    # Small limits, so random requests reach them cheaply; a small KV cache makes start-up quick.
    args = [
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-client-batch-size",
        str(MAX_CLIENT_BATCH),
        "--max-concurrent-requests",
        "64",
        "--max-input-chars",
        str(MAX_INPUT_CHARS),
        "--max-batch-tokens",
        "1024",
        "--kv-cache-memory",
        "64MiB",
    ]
    for name, path in model_dirs.items():
        args += ["--model", str(path), "--served-model-name", name]
    with in_process_server(args) as (target, proc):
        with grpc.insecure_channel(target) as channel:
            yield Served(target, proc, inference_stub(channel))


def assert_healthy(served: Served) -> None:
    pb = pb_module()
    assert served.proc.poll() is None, f"server exited; log tail:\n{log_tail(served.proc.log_path)}"
    assert health_status(served.target, timeout=CALL_TIMEOUT_S) == "SERVING"
    reply = served.stub.Embed(pb.EmbedRequest(model=EMBEDDER, inputs=["hello"]), timeout=CALL_TIMEOUT_S)
    assert len(reply.embeddings) == 1


def fuzz(served: Served, requests: st.SearchStrategy, send: Callable) -> None:
    """Each drawn request through served.attempt(send, ...), then the server must still be fine."""

    @FUZZ_SETTINGS
    @given(request=requests)
    def one(request) -> None:
        served.attempt(send, request)

    one()
    served.report()
    assert_healthy(served)


# --- one sender per RPC: the call, and what an OK answer must look like -------------------------------------


def send_embed(stub, request, timeout: float) -> None:
    reply = stub.Embed(request, timeout=timeout)
    assert len(reply.embeddings) == len(request.inputs)


def send_embed_stream(stub, requests, timeout: float) -> None:
    replies = list(stub.EmbedStream(iter(requests), timeout=timeout))
    # One response per request, in order.
    assert [len(r.embeddings) for r in replies] == [len(r.inputs) for r in requests]


def send_tokenize(stub, request, timeout: float) -> None:
    reply = stub.Tokenize(request, timeout=timeout)
    assert len(reply.inputs) == len(request.inputs)


def send_list_models(stub, request, timeout: float) -> None:
    reply = stub.ListModels(request, timeout=timeout)
    assert [m.name for m in reply.models] == list(SERVED)


def send_rerank(stub, request, timeout: float) -> None:
    reply = stub.Rerank(request, timeout=timeout)
    indices = [r.index for r in reply.results]
    assert len(set(indices)) == len(indices) and all(i < len(request.documents) for i in indices)


def send_classify(stub, request, timeout: float) -> None:
    reply = stub.Classify(request, timeout=timeout)
    assert len(reply.classifications) == len(request.inputs)


def send_generate(stub, request, timeout: float) -> None:
    replies = list(stub.Generate(request, timeout=timeout))
    # The last message carries the finish reason; no more than max_tokens tokens come back.
    assert replies and replies[-1].finish_reason != pb_module().FINISH_REASON_UNSPECIFIED
    assert sum(len(r.token_ids) for r in replies) <= request.max_tokens


# --- one property per RPC -----------------------------------------------------------------------------------


def _rpcs() -> dict[str, tuple[Callable, st.SearchStrategy]]:
    """RPC name -> (its sender, its request strategy)."""
    return {
        "Embed": (send_embed, embed_requests()),
        # 1..3 requests on one stream.
        "EmbedStream": (send_embed_stream, st.lists(embed_requests(), min_size=1, max_size=3)),
        "Tokenize": (send_tokenize, tokenize_requests()),
        "ListModels": (send_list_models, list_models_requests()),
        "Rerank": (send_rerank, rerank_requests()),
        "Classify": (send_classify, classify_requests()),
        "Generate": (send_generate, generate_requests()),
    }


@pytest.mark.parametrize("rpc", ["Embed", "EmbedStream", "Tokenize", "ListModels", "Rerank", "Classify", "Generate"])
def test_rpc(served, rpc):
    send, requests = _rpcs()[rpc]
    fuzz(served, requests, send)


def test_health_check(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    services = st.one_of(st.sampled_from((*SERVED, "", "embedserv.v1.Inference")), st.text(CHARS, max_size=30))
    with grpc.insecure_channel(served.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def send(_, request, timeout: float) -> None:
            try:
                reply = health.Check(request, timeout=timeout)
            except grpc.RpcError as err:
                # The stock health servicer answers an unknown service NOT_FOUND with no message, as the gRPC
                # health protocol has it; our own services must never be unknown.
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                assert request.service not in (*SERVED, ""), f"health does not know {request.service!r}"
                return
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        fuzz(served, services.map(lambda name: health_pb2.HealthCheckRequest(service=name)), send)


# --- all RPCs at once ---------------------------------------------------------------------------------------


def _mixed_calls() -> st.SearchStrategy:
    """(sender, request, timeout): any RPC, now and then with a deadline that expires mid-call."""
    calls = st.one_of(*(st.tuples(st.just(send), requests) for send, requests in _rpcs().values()))
    timeouts = mostly(st.just(CALL_TIMEOUT_S), st.floats(0.001, 0.5), one_in=4)
    return st.tuples(calls, timeouts).map(lambda drawn: (*drawn[0], drawn[1]))


def test_concurrent_calls(served):
    """Random calls at once, each sent 1..4 times over: identical prompts may share cached KV blocks, deadlines
    expire mid-call, and the inputs in flight may pass --max-concurrent-requests."""
    pool = ThreadPoolExecutor(max_workers=48)

    # A batch is many calls, so a third as many batches as other tests draw requests keeps the time alike.
    @settings(FUZZ_SETTINGS, max_examples=max(1, EXAMPLES // 3))
    @given(batch=st.lists(_mixed_calls(), min_size=2, max_size=12), copies=st.integers(1, 4))
    def one(batch, copies) -> None:
        calls = [call for call in batch for _ in range(copies)]
        futures = [pool.submit(served.attempt, send, request, timeout) for send, request, timeout in calls]
        for future in futures:
            future.result()

    with pool:
        one()
    served.report()
    assert_healthy(served)
    # Expired and cancelled generations must give their KV blocks back.
    assert _wait_for_free_kv_blocks(served.stub) == 0


def _wait_for_free_kv_blocks(stub, timeout: float = 10.0) -> int:
    """The generator's used KV blocks once they reach 0, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        models = stub.ListModels(pb_module().ListModelsRequest(), timeout=CALL_TIMEOUT_S).models
        used = next(m.kv_cache.used_blocks for m in models if m.name == GEN)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)
