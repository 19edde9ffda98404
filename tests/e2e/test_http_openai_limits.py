"""/v1/embeddings takes up to OpenAI's 2048 inputs a call: past --max-client-batch-size (32 on the compat
server) the call runs as consecutive slices, answered in input order with usage summed; past 2048 it is
refused in API terms. The other faces' batch limit message reads as a sentence."""

from __future__ import annotations

import numpy as np

from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import (  # noqa: F401
    assert_openai_error,
    assert_tei_error,
    http,
    pb,
    stub,
)
from tests.helpers.compat_server import EMBEDDER, MAX_CLIENT_BATCH

TEXTS = [f"text number {i} about a server that splits calls" + " more" * (i % 7) for i in range(300)]


def test_300_inputs_are_answered_in_order_with_usage_summed(http, stub):
    reply = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": TEXTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [item["index"] for item in body["data"]] == list(range(len(TEXTS)))
    got = np.array([item["embedding"] for item in body["data"]], dtype=np.float32)
    tokens = 0
    for start in range(0, len(TEXTS), MAX_CLIENT_BATCH):
        part = TEXTS[start : start + MAX_CLIENT_BATCH]
        expected = stub.Embed(pb().EmbedRequest(model=EMBEDDER, inputs=part), timeout=RPC_TIMEOUT_S)
        np.testing.assert_allclose(got[start : start + len(part)], [e.values for e in expected.embeddings], atol=1e-5)
        tokens += expected.usage.prompt_tokens
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_token_id_inputs_past_the_batch_limit_are_split_too(http):
    ids = [[101, 7592 + i, 102] for i in range(MAX_CLIENT_BATCH + 5)]
    reply = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": ids})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["data"]) == len(ids)
    assert reply.json()["usage"]["prompt_tokens"] == 3 * len(ids)


def test_late_chunking_spans_follow_their_slice(http):
    texts = TEXTS[: MAX_CLIENT_BATCH + 8]
    late = {"splitter": "spans", "spans": [[[0, 4], [5, 11]] for _ in texts]}
    reply = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": texts, "late_chunking": late})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert [item["input_index"] for item in data] == [i for i in range(len(texts)) for _ in range(2)]
    alone = http.post(
        "/v1/embeddings",
        json={
            "model": EMBEDDER,
            "input": texts[-1:],
            "late_chunking": {"splitter": "spans", "spans": late["spans"][-1:]},
        },
    ).json()["data"]
    np.testing.assert_allclose([d["embedding"] for d in data[-2:]], [d["embedding"] for d in alone], atol=1e-5)
    late["spans"] = late["spans"][:-1]
    reply = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": texts, "late_chunking": late})
    message = assert_openai_error(reply, 400)["message"]
    assert f"late_chunking.spans has {len(texts) - 1} entries for {len(texts)} inputs" in message


def test_past_2048_inputs_is_refused_in_api_terms(http):
    error = assert_openai_error(http.post("/v1/embeddings", json={"model": EMBEDDER, "input": ["a"] * 2049}), 400)
    assert error["message"] == (
        "this endpoint takes at most 2048 inputs per request; got 2049: split them over several requests"
    )


def test_other_faces_batch_limit_reads_as_a_sentence(http, stub):
    message = assert_tei_error(http.post("/embed", json={"inputs": ["a"] * 300}), 422)
    assert "inputs holds 300 items, more than --max-client-batch-size" in message and "300 inputs is" not in message
