"""The client's zero-shot Classify and Generate's decoder_prompt, against an in-process gRPC server that
records the requests: the fields reach the wire, a call is split so that texts x labels fit the server's
batch limit, the parts merge in order, and ModelInfo carries is_encoder_decoder. Sync and async clients."""

from __future__ import annotations

import asyncio

import pytest

from embedserv_client import AsyncClient, Client
from embedserv_client.v1 import embedserv_pb2 as pb
from embedserv_client.v1 import embedserv_pb2_grpc as pb_grpc
from tests.helpers.client import serve_fake_inference

SERVER_BATCH = 4
KINDS = ["sync", "async"]


class Recording(pb_grpc.InferenceServicer):
    """Answers Classify with each candidate label scored by its position and the text's number."""

    def __init__(self) -> None:
        self.classify: list[pb.ClassifyRequest] = []
        self.generate: list[pb.GenerateRequest] = []

    def ListModels(self, request, context):
        model = pb.ModelInfo(name="bart", tasks=[pb.TASK_CLASSIFY, pb.TASK_GENERATE], is_encoder_decoder=True)
        return pb.ListModelsResponse(models=[model], limits=pb.ServerLimits(max_client_batch_size=SERVER_BATCH))

    def Classify(self, request, context):
        self.classify.append(request)
        labels = list(request.candidate_labels) or ["x"]
        classifications = []
        for text in request.inputs:
            scores = [pb.LabelScore(label=label, score=float(text) + index / 10) for index, label in enumerate(labels)]
            classifications.append(pb.Classification(scores=scores, label=labels[-1], score=scores[-1].score))
        return pb.ClassifyResponse(classifications=classifications)

    def Generate(self, request, context):
        self.generate.append(request)
        yield pb.GenerateResponse(text="ok", token_ids=[1], finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.fixture
def recording():
    yield from serve_fake_inference(Recording())


def call(kind: str, target: str, method: str, *args, **kwargs):
    """client.method(*args, **kwargs) on a fresh sync or async client; a generate stream's text."""
    if kind == "sync":
        with Client(target) as client:
            result = getattr(client, method)(*args, **kwargs)
            return result.text() if method == "generate" else result

    async def run():
        async with AsyncClient(target) as client:
            result = getattr(client, method)(*args, **kwargs)
            return await result.text() if method == "generate" else await result

    return asyncio.run(run())


@pytest.mark.parametrize("kind", KINDS)
def test_zero_shot_fields_reach_the_server_and_calls_split_by_pairs(recording, kind):
    servicer, target = recording
    texts = [str(i) for i in range(5)]

    results = call(kind, target, "classify", texts, candidate_labels=["b", "a"], hypothesis_template="It is {}.",
                   multi_label=True)  # fmt: skip

    # 2 labels per text and a batch limit of 4 pairs: 2 texts per request.
    assert sorted(len(r.inputs) for r in servicer.classify) == [1, 2, 2]
    for request in servicer.classify:
        assert list(request.candidate_labels) == ["b", "a"]
        assert request.hypothesis_template == "It is {}." and request.multi_label
    assert [list(r.scores) for r in results] == [["b", "a"]] * 5
    assert [r.scores["b"] for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert results[0].scores["a"] == pytest.approx(0.1)


@pytest.mark.parametrize("kind", KINDS)
def test_without_candidate_labels_nothing_changes(recording, kind):
    servicer, target = recording

    single = call(kind, target, "classify", "3")

    (request,) = servicer.classify
    assert list(request.candidate_labels) == [] and request.hypothesis_template == "" and not request.multi_label
    assert single.scores == {"x": 3.0}


@pytest.mark.parametrize("kind", KINDS)
def test_one_label_as_a_string_and_more_labels_than_the_batch(recording, kind):
    servicer, target = recording

    call(kind, target, "classify", ["1", "2"], candidate_labels="sports")
    call(kind, target, "classify", ["1", "2"], candidate_labels=list("abcdef"))

    assert list(servicer.classify[0].candidate_labels) == ["sports"]
    assert list(servicer.classify[0].inputs) == ["1", "2"]
    # 6 labels cannot fit 4 pairs: one text per request (the server says whether it takes 6 pairs).
    assert sorted(len(r.inputs) for r in servicer.classify[1:]) == [1, 1]


@pytest.mark.parametrize("kind", KINDS)
def test_generate_sends_decoder_prompt(recording, kind):
    servicer, target = recording

    assert call(kind, target, "generate", "Translate: hello", decoder_prompt="Bonjour", max_tokens=3) == "ok"
    assert call(kind, target, "generate", "Another") == "ok"

    assert [r.decoder_prompt for r in servicer.generate] == ["Bonjour", ""]
    assert servicer.generate[0].prompt == "Translate: hello" and servicer.generate[0].max_tokens == 3


@pytest.mark.parametrize("kind", KINDS)
def test_models_report_is_encoder_decoder(recording, kind):
    _, target = recording

    (model,) = call(kind, target, "models")

    assert model.is_encoder_decoder and model.tasks == ("classify", "generate")
