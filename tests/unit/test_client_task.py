"""The client's and CLI's `task` (a model's task adapter, jina-embeddings-v3) reaches every Embed request it
sends, split calls included; without it no task is sent."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from embedserv_client import AsyncClient, Client, cli
from embedserv_client.v1 import embedserv_pb2 as pb
from embedserv_client.v1 import embedserv_pb2_grpc as pb_grpc
from tests.helpers.client import serve_fake_inference

SERVER_BATCH = 2


class Recording(pb_grpc.InferenceServicer):
    """Answers Embed with [the text as a number, 1.0] per input and keeps each request."""

    def __init__(self) -> None:
        self.embed: list[pb.EmbedRequest] = []

    def ListModels(self, request, context):
        model = pb.ModelInfo(
            name="jina", tasks=[pb.TASK_EMBED], dimension=2, adapters=["retrieval.query", "separation"]
        )
        return pb.ListModelsResponse(models=[model], limits=pb.ServerLimits(max_client_batch_size=SERVER_BATCH))

    def Embed(self, request, context):
        self.embed.append(request)
        # The client asks for raw little-endian float32 (ENCODING_FLOAT32).
        rows = [np.array([float(text), 1.0], dtype="<f4").tobytes() for text in request.inputs]
        return pb.EmbedResponse(embeddings=[pb.Embedding(raw=row) for row in rows])


@pytest.fixture
def recording():
    yield from serve_fake_inference(Recording())


def embed(kind: str, target: str, *args, **kwargs):
    if kind == "sync":
        with Client(target) as client:
            return client.embed(*args, **kwargs)

    async def run():
        async with AsyncClient(target) as client:
            return await client.embed(*args, **kwargs)

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_task_reaches_every_request_of_a_split_call(recording, kind):
    servicer, target = recording
    texts = [str(i) for i in range(5)]

    vectors = embed(kind, target, texts, task="retrieval.query")

    # The parts may reach the server in any order.
    assert sorted(len(r.inputs) for r in servicer.embed) == [1, 2, 2]
    assert [r.task for r in servicer.embed] == ["retrieval.query"] * 3
    assert vectors[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_without_a_task_none_is_sent(recording, kind):
    servicer, target = recording
    embed(kind, target, ["0"])
    assert [r.task for r in servicer.embed] == [""]


def test_the_cli_sends_its_task(recording, capsys):
    servicer, target = recording
    assert cli.main(["--target", target, "embed", "--task", "separation", "0", "1"]) == 0
    assert [r.task for r in servicer.embed] == ["separation"]
    assert json.loads(capsys.readouterr().out)["embeddings"] == [[0.0, 1.0], [1.0, 1.0]]
