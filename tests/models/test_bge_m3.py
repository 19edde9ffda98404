"""bge-m3's three outputs equal FlagEmbedding's formulas computed with transformers on the same weights.

A tiny random-weight XLM-R saved as a SentenceTransformer (Transformer, CLS Pooling, Normalize) with
sparse_linear / colbert_linear head files beside it: `.pt` (torch.save of nn.Linear state dicts, as
FlagEmbedding saves them) or `.safetensors`. Our engine runs in process, float32. The reference, per text,
from transformers' last_hidden_state h:
- dense: normalize(h[0]);
- sparse (lexical weights): per token id, the max over its tokens of relu(sparse_linear(h)), the
  tokenizer's cls, eos, pad and unk ids left out (and sep: the copied BERT tokenizer has no eos, bge-m3's
  has </s> for both), only weights above 0;
- multi-vector: normalize(colbert_linear(h[1:])).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from tests.helpers.compare import assert_cosine_at_least, assert_unit_norm, cosines
from tests.helpers.sparse_models import HIDDEN_SIZE, MAX_SEQ_LENGTH, bge_m3_heads, build_bge_m3, copy_model_dir

MIN_COSINE = 0.9999
VOCAB_SIZE = 30522


@pytest.fixture(scope="module")
def sample(texts) -> list[str]:
    return [*texts[:10], "bge-m3 gives dense, sparse and multi-vector outputs.", "word word word"]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("bge-m3")


@pytest.fixture(scope="module")
def pt_dir(model_root):
    return build_bge_m3(model_root, head_format="pt")


@pytest.fixture(scope="module")
def safetensors_dir(model_root, pt_dir):
    # Same seed: the same encoder and the same heads, converted.
    return build_bge_m3(model_root, head_format="safetensors")


@pytest.fixture(scope="module")
def engine():
    """Factory: engine(model_dir, **ModelConfig kwargs) -> a started in-process SyncEngine, shared in the module."""
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    engines = {}
    with contextlib.ExitStack() as stack:

        def get(model_dir, **kwargs):
            key = (str(model_dir), tuple(sorted(kwargs.items())))
            if key not in engines:
                config = ModelConfig(path=str(model_dir), served_name="m", dtype="float32", **kwargs)
                engines[key] = stack.enter_context(SyncEngine(config, warm_up=False))
            return engines[key]

        yield get


@pytest.fixture(scope="module")
def reference(pt_dir, sample):
    """(dense [n, hidden], lexical weights {id: weight} per text, colbert vectors [len - 1, hidden] per text)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pt_dir))
    model = AutoModel.from_pretrained(str(pt_dir), attn_implementation="eager").eval()
    heads = bge_m3_heads(pt_dir)
    sparse, colbert = heads["sparse_linear"], heads["colbert_linear"]
    special = {
        tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[name])
        for name in ("cls_token", "eos_token", "sep_token", "pad_token", "unk_token")
        if name in tokenizer.special_tokens_map
    }
    dense, lexical, vectors = [], [], []
    with torch.no_grad():
        for text in sample:
            encoded = tokenizer(text, truncation=True, max_length=MAX_SEQ_LENGTH, return_tensors="pt")
            hidden = model(**encoded).last_hidden_state[0]
            dense.append(F.normalize(hidden[0], dim=-1).numpy())
            weights = torch.relu(F.linear(hidden, sparse["weight"], sparse["bias"]))[:, 0]
            result: dict[int, float] = {}
            for token_id, weight in zip(encoded["input_ids"][0].tolist(), weights.tolist(), strict=True):
                if token_id not in special and weight > 0 and weight > result.get(token_id, 0.0):
                    result[token_id] = weight
            lexical.append(result)
            vectors.append(F.normalize(F.linear(hidden[1:], colbert["weight"], colbert["bias"]), dim=-1).numpy())
    return np.stack(dense), lexical, vectors


def _all_outputs(**kwargs):
    from embedserv.types import EmbedOutput, EmbedParams

    outputs = (EmbedOutput.DENSE, EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR)
    return EmbedParams(outputs=outputs, truncate=True, **kwargs)


def _one_output(output):
    from embedserv.types import EmbedParams

    return EmbedParams(outputs=(output,), truncate=True)


def assert_lexical_weights(vectors, expected: list[dict[int, float]]) -> None:
    for i, (vector, weights) in enumerate(zip(vectors, expected, strict=True)):
        ids = sorted(weights)
        np.testing.assert_array_equal(vector.indices, ids, err_msg=f"input {i}: ids differ")
        np.testing.assert_allclose(vector.values, [weights[t] for t in ids], rtol=0, atol=1e-4, err_msg=f"input {i}")


def assert_token_vectors(vectors, expected: list[np.ndarray]) -> None:
    for i, (got, want) in enumerate(zip(vectors, expected, strict=True)):
        assert got.shape == want.shape, f"input {i}: {got.shape} token vectors, the reference {want.shape}"
        assert got.dtype == np.float32
        assert_cosine_at_least(got, want, MIN_COSINE, what=f"input {i}: ")


def test_three_outputs_match_the_reference(pt_dir, engine, reference, sample):
    dense, lexical, colbert = reference

    result = engine(pt_dir, allow_pickle=True).embed(sample, _all_outputs())

    assert_cosine_at_least(result.embeddings, dense, MIN_COSINE, sample, what="dense: ")
    assert_unit_norm(result.embeddings)
    assert_lexical_weights(result.sparse, lexical)
    assert_token_vectors(result.multi_vectors, colbert)
    # The comparison means something: most texts keep lexical weights, and none keeps every token.
    assert sum(len(w) > 0 for w in lexical) >= len(sample) - 2
    assert sum(len(v.indices) for v in result.sparse) < sum(len(v) for v in colbert)


def test_model_info_lists_all_three_outputs(pt_dir, engine):
    from embedserv.types import EmbedOutput, Task

    info = engine(pt_dir, allow_pickle=True).info
    assert info.outputs == (EmbedOutput.DENSE, EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR)
    assert {Task.EMBED, Task.EMBED_SPARSE, Task.EMBED_MULTI_VECTOR} <= set(info.tasks)
    widths = (info.dimension, info.sparse_dimension, info.multi_vector_dimension)
    assert widths == (HIDDEN_SIZE, VOCAB_SIZE, HIDDEN_SIZE)
    assert info.pooling == "cls"


def test_one_forward_pass_serves_all_three_outputs(pt_dir, engine, sample):
    """One call asking for dense, sparse and multi-vector runs the model once, and gives what three calls
    asking for one output each give."""
    from embedserv.types import EmbedOutput

    served = engine(pt_dir, allow_pickle=True)
    texts = sample[-4:]
    model = served.core.workers[0].runner.model
    calls = []
    forward = model.forward

    def counting_forward(*args, **kwargs):
        calls.append(len(args[0]))
        return forward(*args, **kwargs)

    model.forward = counting_forward
    try:
        together = served.embed(texts, _all_outputs())
        assert len(calls) == 1, f"{len(calls)} forward passes for one call"
        dense = served.embed(texts, _one_output(EmbedOutput.DENSE))
        sparse = served.embed(texts, _one_output(EmbedOutput.SPARSE))
        multi = served.embed(texts, _one_output(EmbedOutput.MULTI_VECTOR))
    finally:
        del model.forward
    assert len(calls) == 4

    np.testing.assert_allclose(together.embeddings, dense.embeddings, rtol=0, atol=1e-6)
    assert dense.sparse is None and dense.multi_vectors is None and sparse.embeddings is None
    for a, b in zip(together.sparse, sparse.sparse, strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_allclose(a.values, b.values, rtol=0, atol=1e-6)
    for a, b in zip(together.multi_vectors, multi.multi_vectors, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_pickle_heads_are_refused_without_allow_pickle(pt_dir):
    from embedserv.config import ModelConfig
    from embedserv.errors import ConfigError
    from tests.helpers.models import load_in_process

    with pytest.raises(ConfigError, match=r"sparse_linear\.pt is a pickle file.*--allow-pickle"):
        load_in_process(ModelConfig(path=str(pt_dir), served_name="m", dtype="float32"))


def test_pickle_head_holding_code_is_refused_even_with_allow_pickle(pt_dir, model_root):
    """--allow-pickle reads tensors through torch's weights-only unpickler: a head that would call a
    function when unpickled is refused, and the function never runs."""
    import os

    import torch

    from embedserv.config import ModelConfig
    from embedserv.errors import ConfigError
    from tests.helpers.models import load_in_process

    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    model_dir = copy_model_dir(pt_dir, model_root / "bge-m3-bad-head")
    torch.save({"weight": Payload()}, model_dir / "colbert_linear.pt")

    with pytest.raises(ConfigError, match=r"colbert_linear\.pt was refused, even with --allow-pickle.*getcwd"):
        load_in_process(ModelConfig(path=str(model_dir), served_name="m", dtype="float32", allow_pickle=True))


def test_safetensors_heads_load_without_allow_pickle(pt_dir, safetensors_dir, engine, sample):
    assert not list(safetensors_dir.glob("*.pt"))

    converted = engine(safetensors_dir).embed(sample, _all_outputs())
    original = engine(pt_dir, allow_pickle=True).embed(sample, _all_outputs())

    np.testing.assert_allclose(converted.embeddings, original.embeddings, rtol=0, atol=1e-6)
    for a, b in zip(converted.sparse, original.sparse, strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_allclose(a.values, b.values, rtol=0, atol=1e-6)
    for a, b in zip(converted.multi_vectors, original.multi_vectors, strict=True):
        assert a.shape == b.shape and np.all(cosines(a, b) >= MIN_COSINE)


def test_sparse_top_k_and_special_tokens(pt_dir, engine, reference, sample):
    """top_k keeps the k largest lexical weights; no special token id ([CLS], [SEP], [PAD], [UNK]) appears."""
    from embedserv.types import EmbedOutput, EmbedParams

    served = engine(pt_dir, allow_pickle=True)
    top = served.embed(sample, EmbedParams(outputs=(EmbedOutput.SPARSE,), truncate=True, sparse_top_k=3)).sparse
    for vector, weights in zip(top, reference[1], strict=True):
        best = sorted(sorted(weights, key=weights.get, reverse=True)[:3])
        np.testing.assert_array_equal(vector.indices, best)
    everything = np.concatenate([v.indices for v in served.embed(sample, _one_output(EmbedOutput.SPARSE)).sparse])
    assert not set(everything.tolist()) & {0, 100, 101, 102}


@pytest.mark.slow
def test_embed_sparse_over_grpc(safetensors_dir, reference, sample):
    """`embedserv serve` on bge-m3: ListModels reports the three outputs, EmbedSparse returns the lexical
    weights (a server start costs 5-10 s, hence slow)."""
    from embedserv.v1 import embedserv_pb2 as pb
    from embedserv.v1 import embedserv_pb2_grpc
    from tests.helpers.server import open_channel, running_server

    args = ["--model", str(safetensors_dir), "--served-model-name", "m3", "--dtype", "float32"]
    with running_server(args) as (target, _), open_channel(target) as channel:
        stub = embedserv_pb2_grpc.InferenceStub(channel)
        (info,) = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
        reply = stub.EmbedSparse(pb.EmbedSparseRequest(model="m3", inputs=sample, truncate=True), timeout=60)

    assert list(info.outputs) == [pb.OUTPUT_DENSE, pb.OUTPUT_SPARSE, pb.OUTPUT_MULTI_VECTOR]
    assert (info.sparse_dimension, info.multi_vector_dimension) == (VOCAB_SIZE, HIDDEN_SIZE)
    assert pb.TASK_EMBED_SPARSE in info.tasks
    for message, weights in zip(reply.embeddings, reference[1], strict=True):
        assert list(message.indices) == sorted(weights)
        np.testing.assert_allclose(message.values, [weights[t] for t in sorted(weights)], rtol=0, atol=1e-4)
