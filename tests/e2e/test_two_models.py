"""One server, an encoder and a decoder embedder: each request reaches the model it names and matches
its reference; each model reports its own attention kind."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest

from benchmarks.corpus import stdlib_texts
from tests.helpers.attention_default import cpu_default
from tests.helpers.client import RPC_TIMEOUT_S, embed_request, inference_stub, response_matrix
from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm
from tests.helpers.inprocess import in_process_server
from tests.helpers.models import reference_token_counts
from tests.helpers.server import health_status

FIRST, SECOND = "minilm", "tiny-qwen3-last"


@pytest.fixture(scope="module")
def tiny_dir(tiny_decoder):
    """A causal GQA decoder embedder with last-token pooling (the Qwen3-Embedding shape)."""
    return tiny_decoder("qwen3", "lasttoken", max_seq_length=128)


@pytest.fixture(scope="module")
def server(bundled_dir, tiny_dir):
    args = [
        "--model", str(bundled_dir), "--served-model-name", FIRST,
        "--model", str(tiny_dir), "--served-model-name", SECOND,
        "--dtype", "float32", "--device", "cpu",
    ]  # fmt: skip
    with in_process_server(args) as (target, proc):
        yield target, proc


@pytest.fixture(scope="module")
def stub(server):
    target, _ = server
    with grpc.insecure_channel(target) as channel:
        yield inference_stub(channel)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return stdlib_texts(12, seed=5)


@pytest.mark.parametrize(("name", "dimension"), [(FIRST, 384), (SECOND, 64)])
def test_each_model_matches_its_reference(name, dimension, stub, texts, bundled_dir, tiny_dir, reference):
    st = reference(bundled_dir if name == FIRST else tiny_dir)

    response = stub.Embed(embed_request(texts, model=name, truncate=True), timeout=RPC_TIMEOUT_S)

    assert response.model == name
    got = response_matrix(response)
    assert got.shape == (len(texts), dimension)
    assert_cosine_at_least(got, st.encode(texts, convert_to_numpy=True), 0.9999, texts, what=f"{name}: ")
    assert_unit_norm(got)
    assert response.usage.prompt_tokens == sum(reference_token_counts(st, texts))


def test_empty_model_field_goes_to_the_first_model(stub):
    response = stub.Embed(embed_request(["hello there"]), timeout=RPC_TIMEOUT_S)
    assert response.model == FIRST
    assert response_matrix(response).shape == (1, 384)


def _default_backend(model_dir) -> str:
    """The backend this machine picks unasked for the model's float32 heads."""
    import torch

    from embedserv.attention.selector import AttentionSpec

    config = json.loads((Path(model_dir) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return cpu_default(AttentionSpec(torch.device("cpu"), torch.float32, head, 1, 1, False))


def test_list_models_in_order(stub, bundled_dir, tiny_dir):
    from embedserv.v1 import embedserv_pb2 as pb

    models = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
    assert [(m.name, m.dimension, m.pooling, m.max_input_tokens, m.attention) for m in models] == [
        (FIRST, 384, "mean", 256, pb.ATTENTION_KIND_BIDIRECTIONAL),
        (SECOND, 64, "lasttoken", 128, pb.ATTENTION_KIND_CAUSAL),
    ]
    assert [m.architecture for m in models] == ["BertModel", "Qwen3Model"]
    assert [m.attention_backend for m in models] == [_default_backend(bundled_dir), _default_backend(tiny_dir)]


def test_unknown_model_lists_both_names(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(embed_request(["x"], model="other"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert FIRST in err.value.details() and SECOND in err.value.details() and "other" in err.value.details()


def test_health_per_model(server):
    target, _ = server
    assert [health_status(target, s) for s in ("", FIRST, SECOND)] == ["SERVING"] * 3


def test_models_do_not_mix_in_concurrent_calls(stub, texts):
    """Calls to both models in flight at once: each answer still comes from the model it named."""
    futures = [
        stub.Embed.future(embed_request(texts, model=name, truncate=True), timeout=RPC_TIMEOUT_S)
        for name in (FIRST, SECOND, FIRST, SECOND)
    ]
    results = [response_matrix(f.result()) for f in futures]
    assert [r.shape[1] for r in results] == [384, 64, 384, 64]
    np.testing.assert_allclose(results[0], results[2], atol=1e-5)
    np.testing.assert_allclose(results[1], results[3], atol=1e-5)
