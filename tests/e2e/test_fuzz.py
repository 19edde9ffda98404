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
import subprocess
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
from tests.helpers.models import build_tiny_generator
from tests.helpers.scorers import build_cross_encoder
from tests.helpers.server import health_status, log_tail, running_server

EMBEDDER, CROSS, CLASSIFIER, GEN = "minilm", "tiny-ce", "tiny-cls", "tiny-llama"
# The embedder comes first, so an empty model name means it.
SERVED = (EMBEDDER, CROSS, CLASSIFIER, GEN)
MAX_INPUT_CHARS = 300
MAX_CLIENT_BATCH = 8
CALL_TIMEOUT_S = 30.0
EXAMPLES = int(os.environ.get("EMBEDSERV_FUZZ_EXAMPLES", "30"))

ALLOWED = frozenset(getattr(grpc.StatusCode, name) for name in (
    "OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"
))

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
    database=None,
)


def _pb():
    from embedserv.v1 import embedserv_pb2 as pb

    return pb


# --- strategies ---------------------------------------------------------------------------------------------
# Each field is usually valid and now and then wild, so a good share of requests gets past validation into
# tokenization, batching and the model, where the less obvious failures live.

# Protobuf strings must be valid UTF-8, so no lone surrogates; everything else (NUL, controls, emoji) is fair.
CHARS = st.characters(blacklist_categories=("Cs",))
WORDS = ("hello", "world", "zip", "file", "the", "fox", "[CLS]", "[SEP]", "[PAD]", "[UNK]", "<s>", "</s>", "##ing")
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
# Float fields are float32 on the wire; st.floats(width=32) draws nan, +-inf, -0.0, subnormals and huge values.
FLOAT32 = st.floats(width=32)


@st.composite
def mostly(draw, usual: st.SearchStrategy, unusual: st.SearchStrategy, one_in: int = 8):
    """A draw from `unusual` one time in `one_in`, else from `usual` (shrinking leads back to `usual`)."""
    return draw(unusual if draw(st.integers(0, one_in - 1)) == one_in - 1 else usual)


short_texts = st.one_of(st.text(CHARS, max_size=40), st.lists(st.sampled_from(WORDS), max_size=30).map(" ".join))
nonempty_texts = st.one_of(
    st.text(CHARS, min_size=1, max_size=40), st.lists(st.sampled_from(WORDS), min_size=1, max_size=30).map(" ".join)
)
# Around the --max-input-chars limit, and past the 128/256-token windows of the encoders once tokenized.
long_texts = st.text(CHARS, min_size=MAX_INPUT_CHARS - 5, max_size=MAX_INPUT_CHARS + 60)
texts = mostly(short_texts, long_texts, one_in=12)
# 1..8 inputs; sometimes none, or more than --max-client-batch-size.
text_lists = mostly(st.lists(texts, min_size=1, max_size=MAX_CLIENT_BATCH), st.lists(texts, max_size=10))


def model_names(*preferred: str) -> st.SearchStrategy[str]:
    """Mostly models that can answer the RPC; else any served model, "" (the first one) or a random name."""
    others = st.one_of(st.sampled_from((*SERVED, "")), st.text(CHARS, max_size=20))
    return mostly(st.sampled_from(preferred), others, one_in=6)


def enum_values(*valid: int) -> st.SearchStrategy[int]:
    # proto3 enums are open: any int32 reaches the server.
    return mostly(st.sampled_from(valid), INT32)


def prompt_names() -> st.SearchStrategy[str]:
    """Mostly none; the served models define no prompts, so any name is one they do not know."""
    return mostly(st.just(""), st.one_of(st.sampled_from(("query", "document")), st.text(CHARS, max_size=10)))


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """None leaves the field unset."""
    return st.one_of(st.none(), strategy)


def message(cls, **fields: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries(fields).map(lambda drawn: cls(**{k: v for k, v in drawn.items() if v is not None}))


def embed_requests() -> st.SearchStrategy:
    pb = _pb()
    return message(
        pb.EmbedRequest,
        model=model_names(EMBEDDER),
        inputs=text_lists,
        normalize=optional(st.booleans()),
        truncate=st.booleans(),
        truncation_direction=enum_values(0, 1),
        dimensions=optional(mostly(st.integers(1, 384), UINT32)),
        prompt_name=prompt_names(),
        encoding=enum_values(0, 1),
    )


def tokenize_requests() -> st.SearchStrategy:
    pb = _pb()
    return message(
        pb.TokenizeRequest,
        model=model_names(*SERVED),
        inputs=text_lists,
        add_special_tokens=optional(st.booleans()),
        prompt_name=prompt_names(),
    )


def rerank_requests() -> st.SearchStrategy:
    pb = _pb()
    return message(
        pb.RerankRequest,
        model=model_names(CROSS, EMBEDDER),
        query=mostly(nonempty_texts, texts),
        documents=text_lists,
        top_n=optional(mostly(st.integers(0, 10), UINT32)),
        return_documents=st.booleans(),
        raw_scores=st.booleans(),
        truncate=st.booleans(),
        instruction=mostly(st.just(""), texts),
    )


def classify_requests() -> st.SearchStrategy:
    pb = _pb()
    return message(
        pb.ClassifyRequest,
        model=model_names(CLASSIFIER, CROSS),
        inputs=text_lists,
        truncate=st.booleans(),
        truncation_direction=enum_values(0, 1),
        raw_scores=st.booleans(),
    )


def generate_requests() -> st.SearchStrategy:
    pb = _pb()
    return message(
        pb.GenerateRequest,
        model=model_names(GEN),
        prompt=mostly(nonempty_texts, texts),
        # Mostly short so generation stays fast; the huge ones are past any context and must be refused.
        max_tokens=mostly(st.integers(1, 40), st.sampled_from((0, 513, 100_000, 2**32 - 1))),
        temperature=mostly(st.floats(0, 2), FLOAT32),
        top_p=mostly(st.floats(0, 1), FLOAT32),
        top_k=mostly(st.integers(0, 50), UINT32),
        seed=optional(st.integers(0, 2**64 - 1)),
        stop=mostly(st.lists(st.text(CHARS, min_size=1, max_size=3), max_size=3), st.lists(texts, max_size=4)),
        ignore_eos=st.booleans(),
    )


def _unknown_field(number: int, value: int | bytes) -> bytes:
    """One field in protobuf wire format: a varint, or length-delimited bytes."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def list_models_requests() -> st.SearchStrategy:
    # ListModelsRequest has no fields; fields a newer client might send arrive as unknown fields.
    pb = _pb()
    unknown = st.tuples(st.integers(1, 2**29 - 1), st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=20)))
    return st.lists(unknown, max_size=4).map(
        lambda fields: pb.ListModelsRequest.FromString(b"".join(_unknown_field(n, v) for n, v in fields))
    )


# --- the server and the checks ------------------------------------------------------------------------------


@dataclass
class Served:
    target: str
    proc: subprocess.Popen
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
    model_dirs = {
        EMBEDDER: bundled_dir,
        CROSS: build_cross_encoder(root, "bert"),
        CLASSIFIER: build_cross_encoder(root, "xlm-roberta", num_labels=3),
        GEN: build_tiny_generator(root, "llama", seed=5),
    }
    # Small limits, so random requests reach them cheaply; a small KV cache makes start-up quick.
    args = ["--dtype", "float32", "--device", "cpu", "--max-client-batch-size", str(MAX_CLIENT_BATCH),
            "--max-concurrent-requests", "64", "--max-input-chars", str(MAX_INPUT_CHARS),
            "--max-batch-tokens", "1024", "--kv-cache-memory", "64MiB"]
    for name, path in model_dirs.items():
        args += ["--model", str(path), "--served-model-name", name]
    with running_server(args) as (target, proc):
        with grpc.insecure_channel(target) as channel:
            yield Served(target, proc, inference_stub(channel))


def assert_healthy(served: Served) -> None:
    pb = _pb()
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
    assert replies and replies[-1].finish_reason != _pb().FINISH_REASON_UNSPECIFIED
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
        models = stub.ListModels(_pb().ListModelsRequest(), timeout=CALL_TIMEOUT_S).models
        used = next(m.kv_cache.used_blocks for m in models if m.name == GEN)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.1)
