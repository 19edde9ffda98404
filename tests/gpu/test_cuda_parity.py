"""The engine in process on CUDA against the float32 references: embeddings of all-MiniLM-L6-v2 in
float32, float16 and bfloat16, and greedy generation of a tiny random Llama, per attention backend (the
selector's pick, sdpa, varlen, and flex for generation; one that cannot run skips with the selector's reason).

Float32 keeps the design's tolerances (cosine >= 0.9999, token for token). Half precision gets cosine >=
0.999 for embeddings; for generation a half-precision argmax may flip where two logits are close, so
bfloat16 must agree with transformers' bfloat16 generate on CUDA on the first token of most prompts.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.errors import ConfigError
from embedserv.types import EmbedParams, SamplingParams
from tests.helpers.compare import assert_cosine_at_least

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)"),
]

MIN_COSINE = {"float32": 0.9999, "float16": 0.999, "bfloat16": 0.999}
EMBED_BACKENDS = [None, "sdpa", "varlen"]
GENERATE_BACKENDS = [None, "sdpa", "varlen", "flex"]
MAX_TOKENS = 24


def _engine(model_dir, **kwargs) -> SyncEngine:
    """An in-process engine on CUDA, or a skip with the selector's reason where the backend cannot run."""
    config = ModelConfig(path=str(model_dir), served_name="m", device="cuda", **kwargs)
    try:
        return SyncEngine(config)
    except ConfigError as exc:
        pytest.skip(f"{kwargs.get('attention_backend')} cannot run this on CUDA: {exc}")


@pytest.mark.parametrize("backend", EMBED_BACKENDS, ids=lambda b: b or "auto")
@pytest.mark.parametrize("dtype", list(MIN_COSINE))
def test_embeddings_match_sentence_transformers_on_cuda(dtype, backend, gpu_model_dir, reference, texts):
    with _engine(gpu_model_dir, dtype=dtype, attention_backend=backend) as engine:
        assert engine.info.device.startswith("cuda"), engine.info
        what = f"cuda {dtype} {engine.info.attention_backend}: "
        together = engine.embed(texts, EmbedParams(truncate=True)).embeddings
        alone = engine.embed(texts[:1], EmbedParams(truncate=True)).embeddings
    expected = reference(gpu_model_dir).encode(texts, convert_to_numpy=True)
    assert_cosine_at_least(together, expected, MIN_COSINE[dtype], texts, what=what)
    # Batch invariance: a text alone embeds as it does packed with 39 others.
    assert_cosine_at_least(alone, together[:1], MIN_COSINE[dtype], texts[:1], what=what + "alone vs packed: ")


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Twelve prompts from 1 to about 90 words (as tests/models/test_generate_parity.py)."""
    lengths = [1, 2, 3, 5, 8, 12, 17, 25, 33, 45, 60, 90]
    return [" ".join(text.split()[:n]) for text, n in zip(stdlib_texts(12, seed=3), lengths, strict=True)]


def _hf_greedy(model_dir, prompts: list[str], device: str, dtype) -> list[list[int]]:
    """transformers' generate, one prompt at a time (no padding), greedy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=dtype)
    model = model.to(device).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            out.append(generated[0, ids.shape[1] :].tolist())
    return out


def _our_greedy(engine: SyncEngine, prompts: list[str]) -> list[list[int]]:
    results = engine.generate_concurrently(prompts, [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts))
    return [[t for d in deltas for t in d.token_ids] for deltas in results]


@pytest.fixture(scope="module")
def llama_dir(tiny_generator):
    return tiny_generator("llama")


@pytest.fixture(scope="module")
def expected_float32(llama_dir, prompts) -> list[list[int]]:
    """The oracle: transformers on CPU in float32."""
    expected = _hf_greedy(llama_dir, prompts, "cpu", torch.float32)
    assert len({tuple(e) for e in expected}) > 6, "random outputs should differ between prompts"
    return expected


@pytest.mark.parametrize("backend", GENERATE_BACKENDS, ids=lambda b: b or "auto")
def test_greedy_generation_matches_transformers_on_cuda_float32(backend, llama_dir, prompts, expected_float32):
    expected = expected_float32
    # A 64-token budget splits the longer prompts over several steps (chunked prefill).
    with _engine(
        llama_dir, dtype="float32", attention_backend=backend, max_batch_tokens=64, kv_cache_memory=2**28
    ) as engine:
        got = _our_greedy(engine, prompts)
        assert engine.kv_cache_usage().used_blocks == 0
    for prompt, ours, want in zip(prompts, got, expected, strict=True):
        assert ours == want, f"prompt {prompt[:40]!r}: ours {ours} != transformers {want}"


def test_greedy_generation_on_cuda_bfloat16_agrees_with_transformers(llama_dir, prompts):
    expected = _hf_greedy(llama_dir, prompts, "cuda", torch.bfloat16)
    with _engine(llama_dir, dtype="bfloat16", kv_cache_memory=2**28) as engine:
        got = _our_greedy(engine, prompts)
    assert all(got), f"every prompt should generate something: {got}"
    same_first = sum(bool(ours) and bool(want) and ours[0] == want[0] for ours, want in zip(got, expected, strict=True))
    assert same_first >= 0.75 * len(prompts), (
        f"first tokens agree on {same_first} of {len(prompts)}: ours {got}, transformers {expected}"
    )
