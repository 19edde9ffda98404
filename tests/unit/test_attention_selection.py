"""Which attention backend and which causality a model gets, and the errors when a choice cannot run."""

from types import SimpleNamespace

import pytest
import torch

from embedserv import cpu_isa
from embedserv.attention import selector
from embedserv.attention.selector import AttentionSpec, select_backend, unsupported_reason
from embedserv.config import ATTENTION_BACKENDS, ModelConfig
from embedserv.errors import ConfigError
from embedserv.models import registry
from tests.helpers.attention_default import cpu_default

CPU_FP32 = AttentionSpec(torch.device("cpu"), torch.float32, 64, 8, 2, is_causal=True)


def test_every_configurable_backend_is_registered():
    assert set(ATTENTION_BACKENDS) == set(selector._REGISTRY)
    for order in selector.PREFERENCE.values():
        assert set(order) <= set(ATTENTION_BACKENDS)


def test_cpu_default_is_sdpa_or_where_it_measured_faster_cpu_varlen():
    assert select_backend(None, CPU_FP32).name == cpu_default(CPU_FP32)


@pytest.mark.parametrize(
    ("level", "dtype", "head_size", "generates", "expected"),
    [
        ("avx512_bf16", torch.float32, 32, False, "cpu_varlen"),
        ("avx512_bf16", torch.float32, 128, False, "cpu_varlen"),
        ("avx512_bf16", torch.bfloat16, 32, False, "cpu_varlen"),
        ("avx512_bf16", torch.bfloat16, 64, False, "sdpa"),
        ("avx512", torch.float32, 32, False, "sdpa"),
        ("avx2", torch.float32, 32, False, "cpu_varlen"),
        ("avx2", torch.float32, 64, False, "sdpa"),
        ("amx", torch.float32, 32, False, "cpu_varlen"),
        ("amx", torch.float32, 64, False, "sdpa"),
        ("amx", torch.bfloat16, 32, False, "cpu_varlen"),
        ("amx", torch.bfloat16, 64, False, "sdpa"),
        # A model that generates: its decodes decide (cpu_isa: paged_decode against sdpa's decode path), whatever
        # its prompts' head size, on a class where it was measured.
        ("avx512_bf16", torch.bfloat16, 64, True, "cpu_varlen"),
        ("avx512_bf16", torch.bfloat16, 128, True, "cpu_varlen"),
        ("avx512_bf16", torch.float32, 64, True, "cpu_varlen"),
        ("avx512", torch.float32, 64, True, "sdpa"),
        ("avx2", torch.bfloat16, 64, True, "sdpa"),
        ("avx2", torch.float32, 64, True, "cpu_varlen"),
        ("amx", torch.float32, 64, True, "cpu_varlen"),
        ("amx", torch.bfloat16, 64, True, "cpu_varlen"),
    ],
)
def test_cpu_varlen_is_the_default_only_where_it_was_measured_faster(
    monkeypatch, level, dtype, head_size, generates, expected
):
    from embedserv.attention.backends import cpu_varlen_kernel

    monkeypatch.setattr(cpu_varlen_kernel, "compiler", lambda: "c++")
    monkeypatch.setattr(cpu_isa, "detect", lambda: SimpleNamespace(level=level))
    spec = AttentionSpec(torch.device("cpu"), dtype, head_size, 12, 4, is_causal=generates, generates=generates)
    assert select_backend(None, spec).name == expected
    reason = selector._not_default_reason("cpu_varlen", spec)
    if expected == "cpu_varlen":
        assert reason is None
    else:
        what = "a generating model's " if generates else ""
        assert f"not for {what}{str(dtype).removeprefix('torch.')}" in reason


def test_cpu_varlen_without_a_compiler_says_so(monkeypatch):
    from embedserv.attention.backends import cpu_varlen_kernel

    monkeypatch.setattr(cpu_varlen_kernel, "compiler", lambda: None)
    assert "no C++ compiler" in unsupported_reason("cpu_varlen", CPU_FP32)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (AttentionSpec(torch.device("cpu"), torch.float16, 64, 8, 8, False), "float32 and bfloat16"),
        (AttentionSpec(torch.device("cpu"), torch.float32, 256, 8, 8, False), "head sizes 32 to 128"),
        (AttentionSpec(torch.device("cpu"), torch.float32, 16, 8, 8, False), "head sizes 32 to 128"),
        (AttentionSpec(torch.device("cpu"), torch.float32, 64, 8, 8, False, relative_bias=True), "relative position"),
        (AttentionSpec(torch.device("cpu"), torch.float32, 64, 8, 8, False, disentangled=True), "disentangled"),
        (AttentionSpec(torch.device("cuda"), torch.float32, 64, 8, 8, False), "CPU only"),
    ],
)
def test_cpu_varlen_says_what_it_cannot_run(spec, reason):
    assert reason in unsupported_reason("cpu_varlen", spec)
    if spec.device.type == "cpu" and not (spec.relative_bias or spec.disentangled):
        assert select_backend(None, spec).name == "sdpa"


@pytest.mark.parametrize("name", ATTENTION_BACKENDS)
def test_forced_backend_runs_or_says_why_not(name):
    reason = unsupported_reason(name, CPU_FP32)
    if reason is None:
        assert select_backend(name, CPU_FP32).name == name
    else:
        with pytest.raises(ConfigError, match=f"--attention-backend {name} cannot run here: "):
            select_backend(name, CPU_FP32)


@pytest.mark.parametrize("name", ["varlen", "flash_attn"])
def test_cuda_only_backends_name_the_problem_on_cpu(name):
    with pytest.raises(ConfigError) as err:
        select_backend(name, CPU_FP32)
    assert "CUDA" in str(err.value) or "not installed" in str(err.value)


def test_flex_refuses_head_sizes_it_cannot_compile():
    spec = AttentionSpec(torch.device("cpu"), torch.float32, 80, 8, 8, is_causal=False)
    assert "power-of-two head size" in unsupported_reason("flex", spec)


def test_unknown_backend_is_a_config_error_listing_the_choices():
    with pytest.raises(ConfigError) as err:
        ModelConfig(path="x", served_name="m", attention_backend="fast")
    assert "unknown --attention-backend 'fast'" in str(err.value)
    assert all(name in str(err.value) for name in ATTENTION_BACKENDS)


def test_attention_kind_must_be_causal_or_bidirectional():
    with pytest.raises(ConfigError, match="--attention must be one of causal, bidirectional"):
        ModelConfig(path="x", served_name="m", attention="sideways")


@pytest.mark.parametrize(
    ("model_type", "config", "override", "expected"),
    [
        ("bert", {}, None, False),
        ("llama", {}, None, True),
        ("qwen2", {"is_causal": False}, None, False),
        ("qwen2", {"is_causal": True}, None, True),
        ("llama", {}, "bidirectional", False),
        ("bert", {}, "causal", True),
        ("qwen2", {"is_causal": False}, "causal", True),
    ],
)
def test_causality_from_the_config_and_the_override(model_type, config, override, expected):
    entry = registry.lookup(model_type)
    assert registry.is_causal(SimpleNamespace(**config), entry, override) is expected


@pytest.mark.parametrize(("dtype", "head_size"), [(torch.float32, 32), (torch.float32, 128), (torch.bfloat16, 64)])
def test_cpu_varlen_runs_when_asked_for(dtype, head_size):
    spec = AttentionSpec(torch.device("cpu"), dtype, head_size, 12, 12, is_causal=False)
    if unsupported_reason("cpu_varlen", spec) is not None:
        pytest.skip("cpu_varlen cannot run here (no C++ compiler)")
    assert select_backend(None, spec).name == cpu_default(spec)
    assert select_backend("cpu_varlen", spec).name == "cpu_varlen"
