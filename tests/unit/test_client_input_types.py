"""The client refuses a non-str text at its own API, sync and async, with a TypeError that names the argument, the
index and the type it got, before any request leaves (protobuf would fail deep inside with a bare TypeError)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from embedserv_client import AsyncClient, Client
from embedserv_client.v1 import embedserv_pb2 as pb
from embedserv_client.v1 import embedserv_pb2_grpc as pb_grpc
from tests.helpers.client import serve_fake_inference

# As all-MiniLM-L6-v2: a few hundred inputs print more than a pipe's buffer holds.
DIM = 384


class Counting(pb_grpc.InferenceServicer):
    """Counts the requests that reach it; answers Embed with one DIM-dimensional vector per input."""

    def __init__(self) -> None:
        self.calls = 0

    def ListModels(self, request, context):
        self.calls += 1
        model = pb.ModelInfo(name="m", tasks=[pb.TASK_EMBED], dimension=DIM)
        return pb.ListModelsResponse(models=[model], limits=pb.ServerLimits(max_client_batch_size=8))

    def Embed(self, request, context):
        self.calls += 1
        row = np.eye(1, DIM, dtype="<f4")[0].tobytes()
        return pb.EmbedResponse(embeddings=[pb.Embedding(raw=row) for _ in request.inputs])

    def EmbedStream(self, request_iterator, context):
        for request in request_iterator:
            yield self.Embed(request, context)


@pytest.fixture
def counting():
    yield from serve_fake_inference(Counting())


# (method, arguments, the message's start): every method that takes texts, documents or a prompt.
BAD_CALLS = [
    ("embed", (["fine", 42],), "texts[1] must be str, not int (42)"),
    ("embed", ([b"bytes"],), "texts[0] must be str, not bytes"),
    ("embed", (42,), "texts must be str or a sequence of str, not int"),
    ("embed_chunks", ([None],), "texts[0] must be str, not NoneType"),
    ("embed_sparse", ([3.5],), "texts[0] must be str, not float"),
    ("embed_multi_vector", ([["nested"]],), "texts[0] must be str, not list"),
    ("classify", (["ok", "ok", 7],), "texts[2] must be str, not int"),
    ("tokenize", ([{"a": 1}],), "texts[0] must be str, not dict"),
    ("rerank", ("query", ["doc", 1]), "documents[1] must be str, not int"),
    ("rerank", (5, ["doc"]), "query must be str, not int"),
]


def _message(caught: pytest.ExceptionInfo) -> str:
    return str(caught.value)


@pytest.mark.parametrize("method, args, message", BAD_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_sync_client_names_the_argument_index_and_type(counting, method, args, message):
    servicer, target = counting
    with Client(target) as client, pytest.raises(TypeError) as caught:
        getattr(client, method)(*args)
    assert _message(caught).startswith(message)
    assert servicer.calls == 0


@pytest.mark.parametrize("method, args, message", BAD_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
def test_async_client_names_the_argument_index_and_type(counting, method, args, message):
    servicer, target = counting

    async def call():
        async with AsyncClient(target) as client:
            await getattr(client, method)(*args)

    with pytest.raises(TypeError) as caught:
        asyncio.run(call())
    assert _message(caught).startswith(message)
    assert servicer.calls == 0


def test_generate_prompt_stop_and_candidate_labels_are_checked(counting):
    _, target = counting
    with Client(target) as client:
        with pytest.raises(TypeError, match=r"^prompt must be str, not list"):
            client.generate(["a prompt"])
        with pytest.raises(TypeError, match=r"^stop\[0\] must be str, not int"):
            client.generate("a prompt", stop=[0])
        with pytest.raises(TypeError, match=r"^candidate_labels\[1\] must be str, not int"):
            client.classify("text", candidate_labels=["pets", 2])


def test_embed_stream_names_the_batch_and_index(counting):
    _servicer, target = counting
    with Client(target) as client:
        assert [m.shape for m in client.embed_stream([["a", "b"]])] == [(2, DIM)]
        with pytest.raises(TypeError, match=r"^batches\[1\]\[0\] must be str, not int"):
            list(client.embed_stream([["a"], [1]]))
        with pytest.raises(TypeError, match=r"^batches\[0\] must be a sequence of str, not str"):
            list(client.embed_stream(["a whole text, not a batch"]))

    async def collect():
        async with AsyncClient(target) as client:
            return [m async for m in client.embed_stream([["a"], ["b", 2]])]

    with pytest.raises(TypeError, match=r"^batches\[1\]\[1\] must be str, not int"):
        asyncio.run(collect())


def test_good_inputs_still_pass(counting):
    _, target = counting
    with Client(target) as client:
        assert client.embed(["a", np.str_("b")]).shape == (2, DIM)
        assert client.embed(("a", "b")).shape == (2, DIM)
        assert client.embed("a").shape == (DIM,)


# --- the CLI into a closed pipe (`embedserv-client embed ... | head -c 50`) ------------------------------------


def test_cli_into_a_closed_pipe_exits_quietly(counting):
    """The pipe's reader is gone before the CLI writes (as `head -c 50` is once it has read its bytes), so every
    write the CLI makes meets EPIPE: no traceback, and the exit status a shell gives a SIGPIPE'd command."""
    _, target = counting
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "embedserv_client.cli", "--target", target, "embed", "hello world"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, env=_cli_env(),
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE


def test_cli_into_head_prints_the_start_and_no_traceback(counting):
    """Far more output than the pipe holds: the CLI is still writing when `head` has its 50 bytes and exits."""
    _, target = counting
    shell = f"{sys.executable} -m embedserv_client.cli --target {target} embed | head -c 50"
    lines = "".join(f"text {i}\n" for i in range(200))
    done = subprocess.run(["sh", "-c", shell], input=lines, capture_output=True, text=True, timeout=120, env=_cli_env())
    assert done.stdout.startswith('{"embeddings": [[1.0, 0.0, 0.0')
    assert done.stderr == ""


def _cli_env() -> dict[str, str]:
    # The subprocess imports the client from this checkout, as the test does; Python would not flag a
    # closed stdout itself with SIGPIPE ignored (its default), so the CLI's own handling is what is seen.
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
