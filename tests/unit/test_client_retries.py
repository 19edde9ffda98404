"""The client's retries, exactly: a scripted in-process gRPC server fails the first calls with chosen codes.

UNAVAILABLE and RESOURCE_EXHAUSTED are retried with backoff up to RetryPolicy.max_attempts and never past
the call's timeout; other codes are raised at once as EmbedservError with the server's request id; a
Generate stream is retried only before its first message. Sync and async clients both."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from embedserv_client import NO_RETRY, AsyncClient, Client, EmbedservError, RetryPolicy
from embedserv_client.v1 import embedserv_pb2 as pb
from embedserv_client.v1 import embedserv_pb2_grpc as pb_grpc
from tests.helpers.client import serve_fake_inference

FAST = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)
VECTOR = np.arange(4, dtype=np.float32)


class Scripted(pb_grpc.InferenceServicer):
    """Fails each RPC's first calls with the codes in `script[rpc]`, then answers."""

    def __init__(self) -> None:
        self.script: dict[str, list[grpc.StatusCode]] = {}
        self.calls: dict[str, int] = {}
        self.generate_fails_after_first_message = False
        self.authorization: list[str | None] = []

    def _fail_if_scripted(self, rpc: str, context) -> None:
        self.calls[rpc] = self.calls.get(rpc, 0) + 1
        self.authorization.append(dict(context.invocation_metadata()).get("authorization"))
        pending = self.script.get(rpc, [])
        if pending:
            context.set_trailing_metadata((("x-request-id", f"req-{rpc}-{self.calls[rpc]}"),))
            context.abort(pending.pop(0), f"scripted failure {self.calls[rpc]}")

    def Embed(self, request, context):
        self._fail_if_scripted("Embed", context)
        raw = VECTOR.astype("<f4").tobytes()
        return pb.EmbedResponse(embeddings=[pb.Embedding(raw=raw) for _ in request.inputs])

    def ListModels(self, request, context):
        self._fail_if_scripted("ListModels", context)
        return pb.ListModelsResponse(limits=pb.ServerLimits(max_client_batch_size=2))

    def Generate(self, request, context):
        self._fail_if_scripted("Generate", context)
        yield pb.GenerateResponse(text="a", token_ids=[1])
        if self.generate_fails_after_first_message:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica went away mid-stream")
        yield pb.GenerateResponse(
            text="b", token_ids=[2], finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(completion_tokens=2)
        )


@pytest.fixture
def scripted():
    yield from serve_fake_inference(Scripted())


def embed(kind: str, target: str, texts, **client_kwargs):
    if kind == "sync":
        with Client(target, **client_kwargs) as client:
            return client.embed(texts)

    async def run():
        async with AsyncClient(target, **client_kwargs) as client:
            return await client.embed(texts)

    return asyncio.run(run())


def generate(kind: str, target: str, **client_kwargs) -> str:
    if kind == "sync":
        with Client(target, **client_kwargs) as client:
            return client.generate("p").text()

    async def run():
        async with AsyncClient(target, **client_kwargs) as client:
            return await client.generate("p").text()

    return asyncio.run(run())


KINDS = ["sync", "async"]
RETRIED = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("code", RETRIED)
def test_refusals_are_retried_until_the_call_succeeds(scripted, kind, code):
    servicer, target = scripted
    servicer.script["Embed"] = [code, code, code]
    matrix = embed(kind, target, ["x"], retry=FAST, batch_size=8)
    np.testing.assert_array_equal(matrix, VECTOR[None])
    assert servicer.calls["Embed"] == 4


@pytest.mark.parametrize("kind", KINDS)
def test_retries_stop_at_max_attempts_with_the_last_error(scripted, kind):
    servicer, target = scripted
    servicer.script["Embed"] = [grpc.StatusCode.UNAVAILABLE] * 10
    with pytest.raises(EmbedservError) as caught:
        embed(kind, target, ["x"], retry=FAST, batch_size=8)
    assert servicer.calls["Embed"] == FAST.max_attempts
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details == "scripted failure 4" and caught.value.request_id == "req-Embed-4"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INTERNAL]
)
def test_other_codes_are_not_retried(scripted, kind, code):
    servicer, target = scripted
    servicer.script["Embed"] = [code]
    with pytest.raises(EmbedservError) as caught:
        embed(kind, target, ["x"], retry=FAST, batch_size=8)
    assert servicer.calls["Embed"] == 1
    assert caught.value.code == code and caught.value.request_id == "req-Embed-1"


@pytest.mark.parametrize("kind", KINDS)
def test_no_retry_policy_raises_the_first_refusal(scripted, kind):
    servicer, target = scripted
    servicer.script["Embed"] = [grpc.StatusCode.RESOURCE_EXHAUSTED]
    with pytest.raises(EmbedservError) as caught:
        embed(kind, target, ["x"], retry=NO_RETRY, batch_size=8)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and servicer.calls["Embed"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_backoff_never_outlives_the_calls_timeout(scripted, kind):
    servicer, target = scripted
    servicer.script["Embed"] = [grpc.StatusCode.UNAVAILABLE] * 100
    slow = RetryPolicy(max_attempts=100, initial_backoff=0.2, max_backoff=0.2)
    with pytest.raises(EmbedservError) as caught:
        embed(kind, target, ["x"], retry=slow, batch_size=8, timeout=0.5)
    # Waits of 0.1-0.2 s: at most 5 attempts fit in 0.5 s, long before max_attempts. The client gives up
    # with the server's refusal when the next wait would pass the deadline; under load the last attempt
    # can itself run out of time first (DEADLINE_EXCEEDED; seen on a loaded run), which is as right.
    assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert 1 <= servicer.calls["Embed"] <= 5


def test_the_backoff_doubles_up_to_its_cap_with_jitter_and_stops_at_the_deadline():
    policy = RetryPolicy(max_attempts=10, initial_backoff=0.1, max_backoff=0.4, multiplier=2.0)
    unavailable = grpc.StatusCode.UNAVAILABLE
    for attempt, ceiling in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.4), (9, 0.4)]:
        waits = [policy.delay(unavailable, attempt, None) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (attempt, min(waits), max(waits))
        assert max(waits) - min(waits) > ceiling / 4  # jittered, not in step
    assert policy.delay(unavailable, 10, None) is None  # max_attempts reached
    assert policy.delay(grpc.StatusCode.INVALID_ARGUMENT, 1, None) is None
    assert policy.delay(unavailable, 1, time.monotonic() + 0.04) is None  # the wait would pass the deadline
    assert policy.delay(unavailable, 1, time.monotonic() + 10) is not None


@pytest.mark.parametrize("kind", KINDS)
def test_each_split_request_is_retried_on_its_own(scripted, kind):
    servicer, target = scripted
    servicer.script["Embed"] = [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE]
    # No batch_size: the client asks ListModels, which says 2 inputs per call (and is retried too).
    servicer.script["ListModels"] = [grpc.StatusCode.UNAVAILABLE]
    matrix = embed(kind, target, ["a", "b", "c", "d", "e"], retry=FAST)
    assert matrix.shape == (5, 4)
    assert servicer.calls["ListModels"] == 2
    assert servicer.calls["Embed"] == 3 + 2  # three requests of at most 2, two refusals


@pytest.mark.parametrize("kind", KINDS)
def test_generate_is_retried_before_its_first_message_only(scripted, kind):
    servicer, target = scripted
    servicer.script["Generate"] = [grpc.StatusCode.UNAVAILABLE]
    assert generate(kind, target, retry=FAST) == "ab"
    assert servicer.calls["Generate"] == 2
    # Text already handed to the caller cannot be taken back: a stream that fails later is raised.
    servicer.generate_fails_after_first_message = True
    with pytest.raises(EmbedservError) as caught:
        generate(kind, target, retry=FAST)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and servicer.calls["Generate"] == 3


def test_policy_arguments_are_checked():
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="initial_backoff"):
        RetryPolicy(initial_backoff=1.0, max_backoff=0.5)
    with pytest.raises(ValueError, match="batch_size"):
        Client("127.0.0.1:1", batch_size=0)
    with Client("127.0.0.1:1") as client, pytest.raises(TypeError, match="dimension"):
        client.embed_stream([["x"]], dimension=8)  # refused at the call, not at the first next()
    with pytest.raises(ValueError, match="truncation_direction"):
        Client("127.0.0.1:1").classify("x", truncation_direction="middle")


def test_the_api_key_is_sent_as_a_bearer_token_and_kept_out_of_repr(scripted):
    servicer, target = scripted
    with Client(target, api_key="s3cret", batch_size=8) as client:
        client.embed("x")
        assert "s3cret" not in repr(client)
    with Client(target, batch_size=8) as client:
        client.embed("x")
    assert servicer.authorization == ["Bearer s3cret", None]
