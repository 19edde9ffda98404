"""The official openai SDK against our OpenAI-compatible routes: the same answers as gRPC from the same
server (embeddings float and base64 with `dimensions`, compact `embedding_type`s and `chunking`; greedy
completions and chat, streamed and not), and the SDK's own exception for each error."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import assert_openai_error, http, stub  # noqa: F401 - the fixtures
from tests.helpers.compat_server import EMBEDDER, GENERATOR, SPARSE

TEXTS = ["The quick brown fox.", "Servers answer over HTTP and gRPC alike.", "ein kurzer deutscher Satz"]


@pytest.fixture(scope="module")
def client(compat_server):
    return openai.OpenAI(base_url=f"{compat_server.http}/v1", api_key="unused", max_retries=0, timeout=60)


def _pb():
    from embedserv.v1 import embedserv_pb2 as pb

    return pb


def _grpc_embed(stub, texts, **fields) -> np.ndarray:
    reply = stub.Embed(_pb().EmbedRequest(model=EMBEDDER, inputs=texts, **fields), timeout=RPC_TIMEOUT_S)
    return np.array([list(e.values) for e in reply.embeddings], dtype=np.float32), reply.usage.prompt_tokens


def _grpc_generate(stub, prompt: str, max_tokens: int) -> tuple[str, str, int]:
    request = _pb().GenerateRequest(model=GENERATOR, prompt=prompt, max_tokens=max_tokens, temperature=0)
    parts = list(stub.Generate(request, timeout=RPC_TIMEOUT_S))
    reason = _pb().FinishReason.Name(parts[-1].finish_reason)
    return "".join(p.text for p in parts), reason, parts[-1].usage.completion_tokens


@pytest.mark.parametrize("encoding_format", ["float", None])
def test_embeddings_equal_grpc(client, stub, encoding_format):
    # None: the SDK asks for base64 on its own and decodes it (numpy float32) into floats.
    extra = {"encoding_format": encoding_format} if encoding_format else {}
    reply = client.embeddings.create(model=EMBEDDER, input=TEXTS, **extra)
    expected, tokens = _grpc_embed(stub, TEXTS)
    got = np.array([d.embedding for d in sorted(reply.data, key=lambda d: d.index)], dtype=np.float32)
    np.testing.assert_array_equal(got, expected)
    assert reply.model == EMBEDDER and reply.object == "list"
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens


def test_embeddings_base64_with_dimensions_equal_grpc(client, stub):
    # Asked for explicitly, base64 comes back as the string: little-endian float32.
    reply = client.embeddings.create(model=EMBEDDER, input=TEXTS[:2], encoding_format="base64", dimensions=64)
    expected, _ = _grpc_embed(stub, TEXTS[:2], dimensions=64)
    got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in reply.data])
    assert got.shape == (2, 64)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


EMBEDDING_TYPES = {
    "float16": "<f2",
    "int8": "i1",
    "uint8": "u1",
    "int8_per_dimension": "i1",
    "uint8_per_dimension": "u1",
    "binary": "i1",
    "ubinary": "u1",
}


def test_embedding_types_are_grpcs_bytes(client, stub, http):
    """encoding_format base64: the bytes gRPC Embed sends in that encoding; float: those values as JSON
    numbers (ints for the integer encodings); float16 is the float32 vector cast. int8 / uint8 carry gRPC's
    encoding_scale (an extension field); the other encodings have none."""
    floats, _ = _grpc_embed(stub, TEXTS)
    for name, dtype in EMBEDDING_TYPES.items():
        wire = _pb().Encoding.Value(f"ENCODING_{name.upper()}")
        request = _pb().EmbedRequest(model=EMBEDDER, inputs=TEXTS, encoding=wire)
        reply = stub.Embed(request, timeout=RPC_TIMEOUT_S)
        raw = [e.raw for e in reply.embeddings]
        encoded = client.embeddings.create(
            model=EMBEDDER, input=TEXTS, encoding_format="base64", extra_body={"embedding_type": name}
        )
        assert [base64.b64decode(d.embedding) for d in encoded.data] == raw, name
        listed = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": TEXTS, "embedding_type": name}).json()
        if name in ("int8", "uint8"):
            assert listed["encoding_scale"] == reply.encoding_scale > 0, "the float32 scale, exactly"
        else:
            assert "encoding_scale" not in listed, name
        vectors = [d["embedding"] for d in listed["data"]]
        assert all(isinstance(x, float if name == "float16" else int) for x in vectors[0]), name
        np.testing.assert_array_equal(np.array(vectors).astype(dtype), [np.frombuffer(r, dtype) for r in raw])
        if name == "float16":
            np.testing.assert_array_equal(np.array(vectors, dtype=np.float16), floats.astype(np.float16))
    assert len(vectors[0]) == 48  # ubinary: 384 bits


def test_chunking_and_refusals(client, stub, http):
    """chunking "mean" equals gRPC's CHUNKING_MEAN; a model without the dense output, chunked token ids and
    an unknown embedding_type are 400s in OpenAI's shape, the first naming what the model serves."""
    long_text = "Chunked text goes on. " * 150
    reply = client.embeddings.create(model=EMBEDDER, input=[long_text, TEXTS[0]], extra_body={"chunking": "mean"})
    expected, tokens = _grpc_embed(stub, [long_text, TEXTS[0]], chunking=_pb().CHUNKING_MEAN)
    np.testing.assert_array_equal(np.array([d.embedding for d in reply.data], dtype=np.float32), expected)
    assert reply.usage.prompt_tokens == tokens > 256
    error = assert_openai_error(http.post("/v1/embeddings", json={"model": SPARSE, "input": "x"}), 400)
    assert "cannot serve Embed; it serves: embed_sparse" in error["message"]
    ids = http.post("/v1/embeddings", json={"model": EMBEDDER, "input": [101, 102], "chunking": "mean"})
    assert "token-id" in assert_openai_error(ids, 400)["message"]
    unknown = http.post("/v1/embeddings", json={"input": "x", "embedding_type": "int4"})
    assert_openai_error(unknown, 400, "embedding_type")


def test_embeddings_of_token_ids_equal_the_text_they_encode(client, stub, compat_server):
    # The ids Tokenize gives for a text (special tokens included) embed to the same vector as the text.
    tokenized = stub.Tokenize(_pb().TokenizeRequest(model=EMBEDDER, inputs=[TEXTS[0]]), timeout=RPC_TIMEOUT_S)
    ids = [t.id for t in tokenized.inputs[0].tokens]
    single = client.embeddings.create(model=EMBEDDER, input=ids)
    batch = client.embeddings.create(model=EMBEDDER, input=[ids, ids[:3]])
    expected, _ = _grpc_embed(stub, TEXTS[:1])
    np.testing.assert_allclose(np.array(single.data[0].embedding, dtype=np.float32), expected[0], atol=1e-6)
    assert len(batch.data) == 2 and single.usage.prompt_tokens == len(ids)


def test_models_list_and_retrieve(client, compat_server):
    ids = [m.id for m in client.models.list().data]
    assert ids == list(compat_server.models)
    assert client.models.retrieve(EMBEDDER).id == EMBEDDER


def test_completion_equals_grpc_generate(client, stub):
    prompt = "Once upon a time"
    reply = client.completions.create(model=GENERATOR, prompt=prompt, max_tokens=12, temperature=0)
    text, reason, completion_tokens = _grpc_generate(stub, prompt, 12)
    assert reply.choices[0].text == text
    assert reply.choices[0].finish_reason == ("length" if reason == "FINISH_REASON_LENGTH" else "stop")
    assert reply.usage.completion_tokens == completion_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + completion_tokens


def test_streamed_completion_equals_grpc_generate_and_ends_with_usage(client, stub):
    prompts = ["Once upon a time", "In a galaxy far away"]
    chunks = list(
        client.completions.create(
            model=GENERATOR,
            prompt=prompts,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = ["", ""]
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [_grpc_generate(stub, p, 10)[0] for p in prompts]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_equals_grpc_generate_on_the_rendered_template(client, stub):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    # The compat model's template; its tokenizer adds no special tokens, so the rendered text is the prompt.
    rendered = "system: Be brief.\nuser: Say hello\nassistant:"
    text, _, completion_tokens = _grpc_generate(stub, rendered, 9)
    reply = client.chat.completions.create(model=GENERATOR, messages=messages, max_tokens=9, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == completion_tokens
    stream = client.chat.completions.create(
        model=GENERATOR, messages=messages, max_completion_tokens=9, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sdk_raises_its_own_errors(client, compat_server):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.embeddings.create(model="no-such-model", input="x")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.BadRequestError, match="input is empty"):
        client.embeddings.create(model=EMBEDDER, input=[])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=EMBEDDER, input="x", dimensions=100000)
    with pytest.raises(openai.BadRequestError, match="chat"):
        client.chat.completions.create(model=EMBEDDER, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=GENERATOR, messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"}
        )
    with pytest.raises(openai.BadRequestError, match="n is not supported"):
        client.completions.create(model=GENERATOR, prompt="x", n=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=GENERATOR, prompt="x", max_tokens=100000)
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=EMBEDDER, input="x", encoding_format="float16")
    assert error.value.body["param"] == "encoding_format" and error.value.body["type"] == "invalid_request_error"


def test_a_lone_surrogate_is_400_not_500(compat_server):
    # JSON can escape a lone surrogate, which is no text: the tokenizer raised TypeError (a 500) on it.
    import httpx

    body = b'{"model": "%s", "input": ["fine", "bad \\ud800 text"]}' % EMBEDDER.encode()
    reply = httpx.post(
        f"{compat_server.http}/v1/embeddings", content=body, timeout=60, headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400 and "input[1] is not valid Unicode" in reply.json()["error"]["message"]
