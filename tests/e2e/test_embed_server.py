"""A real `embedserv serve` on 127.0.0.1 with the bundled all-MiniLM-L6-v2, against sentence-transformers.

One server for the module. Parity on 128 standard-library docstrings, the encodings, Matryoshka
`dimensions`, truncation both ways, usage counts, every refused input with its status code and message,
the metadata RPCs, health and reflection, and that the server still answers after all of it.
"""

from __future__ import annotations

import re
import threading

import grpc
import numpy as np
import pytest

from benchmarks.corpus import stdlib_texts
from tests.helpers.client import RPC_TIMEOUT_S, embed_all, embed_request, inference_stub, response_matrix
from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm, cosines, normalized
from tests.helpers.inprocess import in_process_server
from tests.helpers.models import reference_token_counts
from tests.helpers.server import health_status

SERVED = "minilm"
DIMENSION = 384
MAX_TOKENS = 256
CLIENT_BATCH = 64
# Two client batches of standard-library docstrings, 17,000 tokens before truncation (the longest 2,600).
NUM_TEXTS = 2 * CLIENT_BATCH
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def server(bundled_dir):
    args = [
        "--model", str(bundled_dir), "--served-model-name", SERVED,
        "--max-client-batch-size", str(CLIENT_BATCH), "--dtype", "float32", "--device", "cpu",
    ]  # fmt: skip
    with in_process_server(args) as (target, proc):
        yield target, proc


@pytest.fixture(scope="module")
def channel(server):
    target, _ = server
    with grpc.insecure_channel(target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return inference_stub(channel)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return stdlib_texts(NUM_TEXTS, seed=0)


@pytest.fixture(scope="module")
def expected(bundled_reference, texts) -> np.ndarray:
    return bundled_reference.encode(texts, batch_size=32, convert_to_numpy=True)


@pytest.fixture(scope="module")
def served(stub, texts):
    """The corpus through the server in requests of <= CLIENT_BATCH inputs: (matrix, responses)."""
    return embed_all(stub, texts, CLIENT_BATCH, truncate=True)


def _long_text(st, texts: list[str], min_tokens: int = 2 * MAX_TOKENS) -> str:
    counts = [len(st.tokenizer(t, truncation=False)["input_ids"]) for t in texts]
    i = int(np.argmax(counts))
    assert counts[i] >= min_tokens, f"corpus has no text of {min_tokens}+ tokens (longest {counts[i]})"
    return texts[i]


def _expect_error(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, f"expected {code.name}, got {err.value.code().name}: {err.value.details()}"
    details = err.value.details() or ""
    assert details.strip(), f"{code.name} without a message"
    return details


def _has_number(message: str, number: int) -> bool:
    return re.search(rf"(?<![\d.]){number}(?![\d.])", message.replace(",", "")) is not None


# --- parity --------------------------------------------------------------------------------------


def test_embed_equals_sentence_transformers_on_stdlib_docstrings(served, expected, texts, bundled_reference):
    matrix, responses = served
    counts = reference_token_counts(bundled_reference, texts)
    assert max(counts) == MAX_TOKENS and min(counts) < 10, "the corpus must mix short texts and texts to truncate"

    assert matrix.shape == (len(texts), DIMENSION)
    assert_cosine_at_least(matrix, expected, MIN_COSINE, texts)
    assert_unit_norm(matrix)
    assert [r.model for r in responses] == [SERVED] * len(responses)
    for i, response in enumerate(responses):
        chunk = counts[i * CLIENT_BATCH : (i + 1) * CLIENT_BATCH]
        assert response.usage.prompt_tokens == sum(chunk), f"request {i}: usage differs from the reference tokenizer"
        assert response.usage.completion_tokens == 0
        assert response.timing.total_us > 0


def test_bytes_encoding_equals_float_values(stub, pb, texts):
    batch = texts[:24]
    floats = stub.Embed(embed_request(batch, truncate=True), timeout=RPC_TIMEOUT_S)
    raw = stub.Embed(embed_request(batch, truncate=True, encoding=pb.ENCODING_BYTES), timeout=RPC_TIMEOUT_S)

    assert len(raw.embeddings) == len(batch)
    for i, (f, r) in enumerate(zip(floats.embeddings, raw.embeddings, strict=True)):
        assert len(r.values) == 0, f"input {i}: ENCODING_BYTES also filled values"
        assert len(r.raw) == 4 * DIMENSION, f"input {i}: raw holds {len(r.raw)} bytes"
        assert len(f.raw) == 0, f"input {i}: ENCODING_FLOAT also filled raw"
        np.testing.assert_array_equal(np.frombuffer(r.raw, dtype="<f4"), np.asarray(f.values, dtype=np.float32))
    assert raw.usage.prompt_tokens == floats.usage.prompt_tokens


@pytest.mark.parametrize("dims", [128, 32])
def test_dimensions_truncates_then_normalizes(stub, expected, texts, dims):
    batch = slice(0, CLIENT_BATCH)
    response = stub.Embed(embed_request(texts[batch], truncate=True, dimensions=dims), timeout=RPC_TIMEOUT_S)
    got = response_matrix(response)

    assert got.shape == (CLIENT_BATCH, dims)
    want = normalized(expected[batch, :dims])
    assert_cosine_at_least(got, want, MIN_COSINE, texts[batch])
    assert_unit_norm(got)


def test_dimensions_equal_to_the_model_dimension_is_the_full_embedding(stub, served, texts):
    got = response_matrix(stub.Embed(embed_request(texts[:8], truncate=True, dimensions=DIMENSION), timeout=30))
    assert_cosine_at_least(got, served[0][:8], 0.99999)


def test_normalize_false_keeps_the_direction(stub, served, texts):
    batch = texts[:CLIENT_BATCH]
    raw = response_matrix(stub.Embed(embed_request(batch, truncate=True, normalize=False), timeout=RPC_TIMEOUT_S))
    assert raw.shape == (len(batch), DIMENSION)
    assert_cosine_at_least(raw, served[0][: len(batch)], MIN_COSINE, batch)
    explicit = response_matrix(stub.Embed(embed_request(batch[:4], truncate=True, normalize=True), timeout=30))
    assert_unit_norm(explicit)


def test_empty_model_field_means_the_first_served_model(stub, served, texts):
    response = stub.Embed(embed_request(texts[:4], model="", truncate=True), timeout=RPC_TIMEOUT_S)
    named = stub.Embed(embed_request(texts[:4], model=SERVED, truncate=True), timeout=RPC_TIMEOUT_S)
    assert response.model == SERVED
    assert named.model == SERVED
    assert_cosine_at_least(response_matrix(response), served[0][:4], 0.99999)


def test_left_truncation_keeps_the_end(stub, pb, bundled_reference, texts):
    st = bundled_reference
    long_text = _long_text(st, texts)
    right_expected = st.encode([long_text], convert_to_numpy=True)
    st.tokenizer.truncation_side = "left"
    try:
        left_expected = st.encode([long_text], convert_to_numpy=True)
        left_count = reference_token_counts(st, [long_text])[0]
    finally:
        st.tokenizer.truncation_side = "right"
    assert cosines(left_expected, right_expected)[0] < 0.999, "test text: its start and end embed alike"

    request = embed_request([long_text], truncate=True, truncation_direction=pb.TRUNCATION_DIRECTION_LEFT)
    left = stub.Embed(request, timeout=RPC_TIMEOUT_S)
    right = stub.Embed(embed_request([long_text], truncate=True), timeout=RPC_TIMEOUT_S)

    assert_cosine_at_least(response_matrix(left), left_expected, MIN_COSINE, what="LEFT: ")
    assert_cosine_at_least(response_matrix(right), right_expected, MIN_COSINE, what="RIGHT: ")
    assert left.usage.prompt_tokens == left_count == MAX_TOKENS


def test_concurrent_calls_equal_sequential_ones(stub, served, texts):
    """Calls in flight together are batched by the server; each must still get its own inputs' embeddings."""
    chunks = [(i, texts[i : i + 7]) for i in range(0, 56, 7)]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def call(start: int, batch: list[str]) -> None:
        try:
            results[start] = response_matrix(stub.Embed(embed_request(batch, truncate=True), timeout=RPC_TIMEOUT_S))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=chunk) for chunk in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=RPC_TIMEOUT_S)
    assert not errors, f"concurrent calls failed: {errors[:3]}"
    for start, batch in chunks:
        np.testing.assert_allclose(results[start], served[0][start : start + len(batch)], atol=1e-5)


# --- bad input -----------------------------------------------------------------------------------


def test_empty_inputs_is_invalid_argument(stub):
    message = _expect_error(lambda: stub.Embed(embed_request([]), timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
    assert "input" in message.lower()


def test_too_long_input_without_truncate_gives_index_count_and_limit(stub, bundled_reference, texts):
    long_text = _long_text(bundled_reference, texts)
    n_tokens = len(bundled_reference.tokenizer(long_text, truncation=False)["input_ids"])
    request = embed_request(["short", "also short", long_text], truncate=False)

    message = _expect_error(lambda: stub.Embed(request, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)

    assert _has_number(message, 2), f"the input's index 2 is not in: {message}"
    assert _has_number(message, n_tokens), f"its token count {n_tokens} is not in: {message}"
    assert _has_number(message, MAX_TOKENS), f"the limit {MAX_TOKENS} is not in: {message}"


@pytest.mark.parametrize("dims", [0, DIMENSION + 1, 100_000])
def test_bad_dimensions_name_the_model_dimension(stub, dims):
    request = embed_request(["hello"], dimensions=dims)
    message = _expect_error(lambda: stub.Embed(request, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
    assert _has_number(message, DIMENSION), f"the model's dimension {DIMENSION} is not in: {message}"


def test_unknown_prompt_name_says_the_model_has_none(stub):
    request = embed_request(["hello"], prompt_name="no-such-prompt")
    message = _expect_error(lambda: stub.Embed(request, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
    lowered = message.lower()
    assert "prompt" in lowered, message
    assert re.search(r"\b(no|none|not any)\b", lowered), f"does not say the model has no prompts: {message}"


def test_client_batch_over_the_limit_gives_the_limit(stub):
    request = embed_request(["word"] * (CLIENT_BATCH + 1))
    message = _expect_error(lambda: stub.Embed(request, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
    assert _has_number(message, CLIENT_BATCH), f"the limit {CLIENT_BATCH} is not in: {message}"


def test_client_batch_at_the_limit_is_served(stub):
    response = stub.Embed(embed_request(["word"] * CLIENT_BATCH), timeout=RPC_TIMEOUT_S)
    assert len(response.embeddings) == CLIENT_BATCH


def test_unknown_model_is_not_found_and_lists_served_names(stub):
    request = embed_request(["hello"], model="no-such-model")
    message = _expect_error(lambda: stub.Embed(request, timeout=30), grpc.StatusCode.NOT_FOUND)
    assert "no-such-model" in message
    assert SERVED in message


def test_tasks_the_embedder_cannot_do(stub, pb):
    message = _expect_error(
        lambda: stub.Classify(pb.ClassifyRequest(inputs=["x"]), timeout=30), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "it serves: embed, embed_multi_vector, rerank" in message
    message = _expect_error(
        lambda: list(stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4), timeout=30)),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "cannot serve Generate; it serves: embed, embed_multi_vector, rerank" in message


# --- metadata, streaming, health, reflection -------------------------------------------------------


def test_list_models_describes_minilm(stub, pb):
    response = stub.ListModels(pb.ListModelsRequest(), timeout=30)
    assert [m.name for m in response.models] == [SERVED]
    info = response.models[0]
    assert info.dimension == DIMENSION
    assert info.max_input_tokens == MAX_TOKENS
    assert info.pooling == "mean"
    assert info.attention == pb.ATTENTION_KIND_BIDIRECTIONAL
    assert pb.TASK_EMBED in info.tasks
    assert "Bert" in info.architecture
    assert list(info.prompt_names) == []
    assert info.dtype == "float32"
    # The limits a client sizes its requests by: the flag given, the defaults otherwise.
    assert response.limits.max_client_batch_size == CLIENT_BATCH
    assert response.limits.max_input_chars == 100_000
    assert response.limits.max_concurrent_requests == 512
    # Texts at the character limit (HTTP's body limit is the same figure); no room for images: no model here
    # takes them (tests/e2e/test_images_api.py has a server whose limit counts them).
    assert response.limits.max_receive_message_bytes == (CLIENT_BATCH + 1) * (4 * 100_000 + 16) + 64 * 1024
    assert response.limits.max_images_per_request == 16
    assert list(info.modalities) == ["text"] and info.max_image_bytes == 0


def test_tokenize_matches_the_reference_tokenizer(stub, pb, bundled_reference):
    tokenizer = bundled_reference.tokenizer
    inputs = ["Hello, world!", "Return the absolute value of the argument.", "naïve café — 東京"]

    with_special = stub.Tokenize(pb.TokenizeRequest(inputs=inputs), timeout=30)
    without = stub.Tokenize(pb.TokenizeRequest(inputs=inputs, add_special_tokens=False), timeout=30)

    assert with_special.model == SERVED
    assert len(with_special.inputs) == len(inputs)
    for text, tokenized, bare in zip(inputs, with_special.inputs, without.inputs, strict=True):
        ref = tokenizer(text, return_offsets_mapping=True)
        assert [t.id for t in tokenized.tokens] == ref["input_ids"], text
        assert [t.id for t in bare.tokens] == tokenizer(text, add_special_tokens=False)["input_ids"], text
        assert [t.special for t in tokenized.tokens] == [True] + [False] * (len(ref["input_ids"]) - 2) + [True]
        for token, (start, end) in zip(tokenized.tokens, ref["offset_mapping"], strict=True):
            if not token.special:
                assert (token.start, token.end) == (start, end), f"offsets of {token.text!r} in {text!r}"


def test_embed_stream_answers_each_request_in_order(stub, served, texts):
    sizes = [1, 3, 2, 5, 1]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    requests = [embed_request(texts[s : s + n], truncate=True) for s, n in zip(starts, sizes, strict=True)]

    responses = list(stub.EmbedStream(iter(requests), timeout=RPC_TIMEOUT_S))

    assert len(responses) == len(requests)
    for s, n, response in zip(starts, sizes, responses, strict=True):
        assert response.model == SERVED
        got = response_matrix(response)
        assert got.shape == (n, DIMENSION)
        np.testing.assert_allclose(got, served[0][s : s + n], atol=1e-5)


def test_embed_stream_ends_with_the_status_of_a_bad_request(stub, pb, texts):
    requests = [embed_request(texts[:2], truncate=True), embed_request([]), embed_request(texts[2:4], truncate=True)]
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in stub.EmbedStream(iter(requests), timeout=RPC_TIMEOUT_S):
            received.append(response)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inputs is empty" in info.value.details()
    assert len(received) == 1, "the request before the bad one is answered"


def test_health_is_serving_for_the_server_and_the_model(server):
    target, _ = server
    assert health_status(target, "") == "SERVING"
    assert health_status(target, SERVED) == "SERVING"


def test_reflection_lists_the_inference_service(channel):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    database = ProtoReflectionDescriptorDatabase(channel)
    services = database.get_services()
    assert "embedserv.v1.Inference" in services
    from google.protobuf.descriptor_pool import DescriptorPool

    service = DescriptorPool(database).FindServiceByName("embedserv.v1.Inference")
    assert {"Embed", "EmbedStream", "Tokenize", "ListModels"} <= {m.name for m in service.methods}


# --- last: the server survived everything above ----------------------------------------------------


def test_server_still_answers_after_bad_inputs(server, stub, pb, served, texts):
    _, proc = server
    bad = [
        embed_request([]),
        embed_request(["x"] * (CLIENT_BATCH + 1)),
        embed_request(["hello"], dimensions=0),
        embed_request(["hello"], prompt_name="nope"),
        embed_request(["hello"], model="nope"),
        embed_request([texts[0], "word " * 2000], truncate=False),
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError):
            stub.Embed(request, timeout=30)

    assert proc.poll() is None, f"server exited with {proc.returncode}"
    response = stub.Embed(embed_request(texts[:5], truncate=True), timeout=RPC_TIMEOUT_S)
    np.testing.assert_allclose(response_matrix(response), served[0][:5], atol=1e-5)
    assert proc.poll() is None
