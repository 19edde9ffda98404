"""The sparse (SPLADE) output equals sentence-transformers' SparseEncoder and TEI's splade pooling.

Small random-weight BertForMaskedLM / XLMRobertaForMaskedLM checkpoints (the XLM-R one with an untied
decoder), saved by sentence-transformers 6 as SparseEncoder directories (fill-mask Transformer +
SpladePooling) and as plain masked-LM directories for `--pooling splade`; our engine runs in process,
float32. The oracles: SparseEncoder.encode, and transformers' MLM logits through max(log1p(relu(.))).
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

from tests.helpers.sparse_models import build_splade_encoder, copy_model_dir, load_sparse_reference, save_mlm

VOCAB_SIZE = 30522
# (arch, pooling, activation): each pooling with each activation, each head family with each pooling.
SPLADE_MODELS = [
    ("bert", "max", "relu"),
    ("bert", "sum", "log1p_relu"),
    ("xlm-roberta", "max", "log1p_relu"),
    ("xlm-roberta", "sum", "relu"),
]


@pytest.fixture(scope="module")
def sample(texts) -> list[str]:
    """Some texts longer than the 128-token limit (truncated), some short ones, one of a single word."""
    return [*texts[:10], "SPLADE expands a query over the vocabulary.", "word"]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("sparse-models")


@pytest.fixture(scope="module")
def splade_dir(model_root):
    cache = {}

    def build(arch: str, pooling: str, activation: str):
        if (arch, pooling, activation) not in cache:
            # The XLM-R checkpoint keeps a decoder of its own (and a head bias the logits do not use).
            tied = arch == "bert"
            cache[arch, pooling, activation] = build_splade_encoder(
                model_root, arch, pooling, activation, tie_word_embeddings=tied
            )
        return cache[arch, pooling, activation]

    return build


@pytest.fixture(scope="module")
def engine(splade_dir):
    """Factory: engine(model_dir, **ModelConfig kwargs) -> a started in-process SyncEngine (no warm-up:
    warming a 30k-vocabulary head over the CPU batch sizes costs seconds), shared in the module."""
    from embedserv.config import ModelConfig
    from embedserv.engine.sync import SyncEngine

    engines = {}
    with contextlib.ExitStack() as stack:

        def get(model_dir, warm_up: bool = False, **kwargs):
            key = (str(model_dir), warm_up, tuple(sorted(kwargs.items())))
            if key not in engines:
                config = ModelConfig(path=str(model_dir), served_name="m", dtype="float32", **kwargs)
                engines[key] = stack.enter_context(SyncEngine(config, warm_up=warm_up))
            return engines[key]

        yield get


def _sparse_params(**kwargs):
    from embedserv.types import EmbedOutput, EmbedParams

    return EmbedParams(outputs=(EmbedOutput.SPARSE,), truncate=True, **kwargs)


def assert_sparse_equal(vectors, expected: np.ndarray, what: str = "", atol: float = 1e-4) -> None:
    """Each SparseVector has the non-zero ids of its row of `expected` [n, vocab], values within atol."""
    assert len(vectors) == len(expected)
    for i, (vector, row) in enumerate(zip(vectors, expected, strict=True)):
        support = np.flatnonzero(row > 0)
        assert vector.indices.dtype == np.int64 and vector.values.dtype == np.float32
        np.testing.assert_array_equal(vector.indices, support, err_msg=f"{what}input {i}: non-zero ids differ")
        np.testing.assert_allclose(vector.values, row[support], rtol=0, atol=atol, err_msg=f"{what}input {i}")


@pytest.mark.parametrize(("arch", "pooling", "activation"), SPLADE_MODELS)
def test_sparse_encoder_matches_sentence_transformers(arch, pooling, activation, splade_dir, engine, sample):
    from embedserv.types import EmbedOutput, Task

    model_dir = splade_dir(arch, pooling, activation)
    reference = load_sparse_reference(model_dir)
    expected = reference.encode(sample, convert_to_tensor=True, convert_to_sparse_tensor=False).numpy()

    served = engine(model_dir)
    result = served.embed(sample, _sparse_params())

    assert_sparse_equal(result.sparse, expected, what=f"{arch}/{pooling}/{activation}: ")
    assert result.embeddings is None and result.multi_vectors is None
    # What ListModels reports: the sparse task and output alone, as wide as the vocabulary.
    assert served.info.tasks == (Task.EMBED_SPARSE,)
    assert served.info.outputs == (EmbedOutput.SPARSE,)
    assert served.info.sparse_dimension == VOCAB_SIZE == expected.shape[1]
    assert served.info.dimension == 0


def test_top_k_keeps_the_k_largest_values(splade_dir, engine, sample):
    served = engine(splade_dir(*SPLADE_MODELS[0]))
    full = served.embed(sample, _sparse_params()).sparse
    top = served.embed(sample, _sparse_params(sparse_top_k=5)).sparse

    for vector, whole in zip(top, full, strict=True):
        assert len(vector.indices) == min(5, len(whole.indices))
        assert np.all(np.diff(vector.indices) > 0), "indices must stay ascending"
        kept = dict(zip(whole.indices.tolist(), whole.values.tolist(), strict=True))
        np.testing.assert_array_equal(vector.values, [kept[i] for i in vector.indices.tolist()])
        # Nothing left out is larger than what was kept.
        assert min(vector.values) >= np.sort(whole.values)[-len(vector.values)]


def _tei_splade(model_dir, texts: list[str]) -> np.ndarray:
    """TEI's splade pooling computed with transformers: max over tokens of log1p(relu(MLM logits))."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForMaskedLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            encoded = tokenizer(text, truncation=True, max_length=128, return_tensors="pt")
            logits = model(**encoded).logits[0]
            rows.append(torch.log1p(torch.relu(logits)).amax(dim=0).numpy())
    return np.stack(rows)


def test_pooling_splade_on_a_plain_masked_lm_is_teis_splade(model_root, engine, sample):
    model_dir = save_mlm(model_root, "bert")
    assert not (model_dir / "modules.json").exists()

    served = engine(model_dir, pooling="splade")
    result = served.embed(sample, _sparse_params())

    assert_sparse_equal(result.sparse, _tei_splade(model_dir, sample), what="--pooling splade: ")
    assert served.info.pooling == "splade"
    assert served.info.sparse_dimension == VOCAB_SIZE


def test_pooling_splade_refuses_a_model_without_a_masked_lm_head(model_root):
    """A bare encoder (BertModel) has no vocabulary logits: refused at start-up, not served wrong."""
    from embedserv.config import ModelConfig
    from embedserv.errors import ConfigError
    from embedserv.models.loading.spec_reader import read_model_spec

    bare = copy_model_dir(save_mlm(model_root, "bert"), model_root / "bare-bert", {"architectures": ["BertModel"]})

    with pytest.raises(ConfigError, match=r"--pooling splade needs a masked-LM checkpoint .*BertModel"):
        read_model_spec(ModelConfig(path=str(bare), served_name="m", dtype="float32", pooling="splade"))


def test_a_masked_lm_checkpoint_without_its_head_is_refused(model_root):
    """config.json says BertForMaskedLM, but the weights are the bare encoder's: a start-up error naming
    the missing head tensors (transformers would start the head at random)."""
    from safetensors.torch import load_file, save_file

    from embedserv.config import ModelConfig
    from embedserv.errors import ConfigError
    from tests.helpers.models import load_in_process

    headless = copy_model_dir(save_mlm(model_root, "bert"), model_root / "headless-bert")
    weights = load_file(str(headless / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("cls.")}, str(headless / "model.safetensors"))

    with pytest.raises(ConfigError, match=r"masked-LM head.*lacks cls\.predictions\.transform\.dense\.weight"):
        load_in_process(ModelConfig(path=str(headless), served_name="m", dtype="float32", pooling="splade"))


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_logits_in_chunks_equal_one_pass(pooling, splade_dir):
    """Sequences split across chunks of tokens pool as in one pass."""
    import torch

    from embedserv.config import ModelConfig
    from embedserv.models.heads.pooling import TokenInputs
    from embedserv.models.heads.splade import build_splade_head
    from embedserv.models.loading.spec_reader import read_model_spec

    activation = "relu" if pooling == "max" else "log1p_relu"
    model_dir = splade_dir("bert", pooling, activation)
    spec = read_model_spec(ModelConfig(path=str(model_dir), served_name="m", dtype="float32"))
    head = build_splade_head(spec)
    assert head.pooling == pooling and head.chunk_tokens > 1000
    lengths = np.array([3, 17, 1, 4, 9, 30], dtype=np.int64)
    total = int(lengths.sum())
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(total + 5, 64, generator=generator)
    # Rows out of order and a few hidden rows unused, as when other sequences share the batch.
    rows = torch.randperm(total + 5, generator=generator)[:total]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.from_numpy(lengths))
    tokens = TokenInputs(rows, seq, torch.zeros(total, dtype=torch.int64), tuple(range(len(lengths))), lengths)

    with torch.inference_mode():
        whole = head(hidden, tokens)
        # 4 ends a chunk at a sequence's end (token 20) and splits the last one over 8 chunks; 1 and 7 too.
        for chunk_tokens in (4, 1, 7):
            head.chunk_tokens = chunk_tokens
            chunked = head(hidden, tokens)
            for a, b in zip(whole[:2], chunked[:2], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(whole[2], chunked[2], rtol=1e-6, atol=1e-6)
    # Sorted by (sequence, id), every sequence present, values above 0.
    key = whole[0] * VOCAB_SIZE + whole[1]
    assert torch.all(key[1:] > key[:-1]) and torch.all(whole[2] > 0)
    assert set(whole[0].tolist()) == set(range(len(lengths)))


def test_warm_up_runs_the_sparse_head(splade_dir, engine):
    """A sparse-only model has no pooler: its warm-up runs the sparse output (8, 128 and 160 tokens here)."""
    served = engine(splade_dir(*SPLADE_MODELS[0]), warm_up=True, max_batch_tokens=160)
    assert served.embed(["warm"], _sparse_params()).sparse[0].indices.size > 0


def test_sparse_encoder_files_as_saved(splade_dir):
    """The directory is what sentence-transformers 6 writes for a SparseEncoder (what the reader must accept)."""
    model_dir = splade_dir(*SPLADE_MODELS[1])
    modules = json.loads((model_dir / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "SpladePooling"]
    assert json.loads((model_dir / "sentence_bert_config.json").read_text())["transformer_task"] == "fill-mask"
    assert json.loads((model_dir / "config_sentence_transformers.json").read_text())["model_type"] == "SparseEncoder"
