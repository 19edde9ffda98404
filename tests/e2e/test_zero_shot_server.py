"""Zero-shot Classify and the new request fields over gRPC: one server with a tiny NLI classifier, a
sentiment classifier (no entailment label), a tiny decoder-only generator and a tiny T5 (encoder-decoder:
Generate with a decoder_prompt equals transformers' greedy generate).

Candidate labels come back in the request's order with the pipeline's scores (the client too, sync and
async); bad zero-shot fields, too many pairs and a decoder_prompt for a decoder-only model are
INVALID_ARGUMENT with the field named; ListModels reports is_encoder_decoder.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.client_drivers import driver
from tests.helpers.inprocess import in_process_server
from tests.helpers.models import build_tiny_generator
from tests.helpers.nli_models import build_nli_classifier, zero_shot_reference
from tests.helpers.seq2seq_models import build_tiny_t5

NLI, SENTIMENT, GEN, T5 = "nli", "sentiment", "gen", "t5"
SERVER_BATCH = 8
TEXTS = [
    "The cat slept on the warm windowsill all afternoon.",
    "Stocks fell sharply after the central bank raised interest rates.",
    "Heavy rain and strong winds are expected along the coast tonight.",
]
LABELS = ["weather", "animals", "finance"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-zero-shot")
    return {
        NLI: build_nli_classifier(root, "bert"),
        SENTIMENT: build_nli_classifier(root, "bert", labels=("negative", "neutral", "positive"), seed=1),
        GEN: build_tiny_generator(root, "llama", seed=5),
        T5: build_tiny_t5(root, variant="v1.1", tied=False),
    }


@pytest.fixture(scope="module")
def target(model_dirs):
    args = ["--dtype", "float32", "--device", "cpu", "--max-client-batch-size", str(SERVER_BATCH),
            "--kv-cache-memory", "64MiB"]  # fmt: skip
    for name, path in model_dirs.items():
        args += ["--model", str(path), "--served-model-name", name]
    with in_process_server(args) as (target, _):
        yield target


def test_zero_shot_scores_candidate_labels_in_request_order(stub, pb, model_dirs):
    template = "This text is about {}."
    expected = zero_shot_reference(model_dirs[NLI], TEXTS[:2], LABELS, hypothesis_template=template)
    request = pb.ClassifyRequest(model=NLI, inputs=TEXTS[:2], candidate_labels=LABELS, hypothesis_template=template)

    response = stub.Classify(request, timeout=RPC_TIMEOUT_S)

    assert len(response.classifications) == 2
    for row, want in zip(response.classifications, expected, strict=True):
        assert [s.label for s in row.scores] == LABELS
        np.testing.assert_allclose([s.score for s in row.scores], [want[label] for label in LABELS], atol=1e-4)
        best = max(want, key=want.get)
        assert row.label == best and row.score == pytest.approx(want[best], abs=1e-4)
    assert response.model == NLI and response.usage.prompt_tokens > 0


def test_client_passes_the_zero_shot_fields_and_splits_by_pairs(target, model_dirs):
    # 3 texts x 3 labels = 9 pairs, past the server's 8: the client sends 2 texts (6 pairs) per request.
    expected = zero_shot_reference(model_dirs[NLI], TEXTS, LABELS, multi_label=True)
    for kind in ("sync", "async"):
        client = driver(kind, target, model=NLI, timeout=RPC_TIMEOUT_S)
        try:
            results = client.classify(TEXTS, candidate_labels=LABELS, multi_label=True)
        finally:
            client.close()
        assert [list(r.scores) for r in results] == [LABELS] * len(TEXTS)
        for got, want in zip(results, expected, strict=True):
            np.testing.assert_allclose(
                [got.scores[label] for label in LABELS], [want[label] for label in LABELS], atol=1e-4
            )


def test_list_models_reports_is_encoder_decoder(stub, pb):
    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT_S).models}

    assert not models[GEN].is_encoder_decoder and not models[NLI].is_encoder_decoder
    assert models[T5].is_encoder_decoder and models[T5].kv_cache.total_blocks > 0
    assert list(models[NLI].labels) == ["contradiction", "neutral", "entailment"]


def test_generate_on_an_encoder_decoder_model_with_a_decoder_prompt(stub, pb, model_dirs):
    from tests.models.test_seq2seq_generation import MAX_TOKENS, hf_generate

    prompt, decoder_prompt = "Return the JSON object for the file name.", "The file"
    expected = hf_generate(model_dirs[T5], [prompt], [decoder_prompt])[0]
    request = pb.GenerateRequest(model=T5, prompt=prompt, decoder_prompt=decoder_prompt, max_tokens=MAX_TOKENS)
    responses = list(stub.Generate(request, timeout=RPC_TIMEOUT_S))
    assert [t for r in responses for t in r.token_ids] == expected
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dirs[T5]))
    # Usage: the encoder's tokens, the decoder's start token and the decoder prompt's tokens.
    decoder_tokens = len(tokenizer(decoder_prompt, add_special_tokens=False).input_ids)
    assert responses[-1].usage.prompt_tokens == len(tokenizer(prompt).input_ids) + 1 + decoder_tokens


def _refusal(call) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details()


def test_bad_fields_are_invalid_argument_naming_the_field(stub, pb):
    def classify(**fields):
        fields.setdefault("model", NLI)
        fields.setdefault("inputs", TEXTS[:1])
        return lambda: stub.Classify(pb.ClassifyRequest(**fields), timeout=RPC_TIMEOUT_S)

    assert "candidate_labels needs an NLI model" in _refusal(classify(model=SENTIMENT, candidate_labels=LABELS))
    assert "candidate_labels[1] is empty" in _refusal(classify(candidate_labels=["a", ""]))
    assert "hypothesis_template" in _refusal(classify(candidate_labels=LABELS, hypothesis_template="No slot."))
    assert "hypothesis_template needs candidate_labels" in _refusal(classify(hypothesis_template="About {}."))
    assert "multi_label needs candidate_labels" in _refusal(classify(multi_label=True))
    too_many = _refusal(classify(inputs=TEXTS, candidate_labels=LABELS))
    assert "3 inputs x 3 candidate_labels make 9 pairs" in too_many and "--max-client-batch-size 8" in too_many

    generate = pb.GenerateRequest(model=GEN, prompt="The river", max_tokens=2, decoder_prompt="It")
    details = _refusal(lambda: list(stub.Generate(generate, timeout=RPC_TIMEOUT_S)))
    assert "decoder_prompt is only for encoder-decoder models" in details and repr(GEN) in details
