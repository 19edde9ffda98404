"""The CPU probe and what depends on it, on faked machines: the start-up warning for a dtype the CPU
emulates, and the constants chosen per ISA class."""

from __future__ import annotations

import logging

import pytest
import torch

from embedserv import cpu_isa
from embedserv.attention.backends import cpu_varlen_kernel, sdpa
from embedserv.config import ModelConfig
from embedserv.engine.served_model import log_spec, read_served_model

AVX2_EPYC = cpu_isa.CpuIsa("AMD EPYC 7B13", frozenset({"sse4_2", "avx", "avx2", "fma"}))
AVX512_BF16 = cpu_isa.CpuIsa("Intel Xeon 8375C", frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}))
AMX = cpu_isa.CpuIsa(
    "Intel Xeon 8480+", frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"})
)
AVX512_ONLY = cpu_isa.CpuIsa("Intel Xeon 8175M", frozenset({"avx2", "avx512f"}))


@pytest.fixture
def fake_cpu(monkeypatch):
    """Makes cpu_isa.detect() say `isa` for the test. Nothing it runs may load the cpu_varlen kernel: the process
    keeps the first build it loads (built for the faked CPU's class), and later tests in it would run that build."""
    loaded = dict(cpu_varlen_kernel._loaded)

    def use(isa: cpu_isa.CpuIsa) -> None:
        monkeypatch.setattr(cpu_isa, "detect", lambda: isa)

    yield use
    assert cpu_varlen_kernel._loaded == loaded, "a test with a faked CPU loaded the cpu_varlen kernel"


def test_cpuinfo_is_read_for_the_model_name_and_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 avx avx2 fma\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 avx avx2 fma\n"
    )
    isa = cpu_isa._read_cpuinfo(cpuinfo)
    assert isa.model_name == "AMD EPYC 7B13"
    assert isa.flags == {"fpu", "sse4_2", "avx", "avx2", "fma"}
    assert (isa.level, isa.native_bf16, isa.vnni) == ("avx2", False, False)


def test_a_missing_cpuinfo_gives_an_empty_probe(tmp_path):
    isa = cpu_isa._read_cpuinfo(tmp_path / "absent")
    assert isa.flags == frozenset() and isa.level == "baseline" and isa.model_name


@pytest.mark.parametrize(
    ("isa", "level", "bf16", "vnni"),
    [
        (AVX2_EPYC, "avx2", False, False),
        (AVX512_ONLY, "avx512", False, False),
        (AVX512_BF16, "avx512_bf16", True, True),
        (AMX, "amx", True, True),
    ],
)
def test_levels_and_capabilities(isa, level, bf16, vnni):
    assert (isa.level, isa.native_bf16, isa.vnni) == (level, bf16, vnni)
    assert isa.model_name in isa.summary() and ("native bf16" in isa.summary()) == bf16


ZEN4 = cpu_isa.CpuIsa("AMD EPYC 9B14", frozenset({"fma", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}))


@pytest.mark.parametrize(
    ("cap", "level", "vnni", "bf16"),
    [
        ("AVX2", "avx2", False, False),
        ("avx2", "avx2", False, False),
        ("AVX512_CORE", "avx512", False, False),
        ("AVX512_CORE_VNNI", "avx512", True, False),
        ("AVX512_CORE_BF16", "avx512_bf16", True, True),
        ("AVX512_CORE_AMX", "avx512_bf16", True, True),  # a cap enables nothing the CPU lacks
        ("SSE41", "baseline", False, False),
    ],
)
def test_onednn_max_cpu_isa_caps_what_the_probe_reports(cap, level, vnni, bf16):
    """oneDNN runs the capped ISA's kernels (no VNNI under AVX2 or AVX512_CORE), so int8 must choose as such a
    CPU would; flags that are not ISA levels stay."""
    isa = cpu_isa.capped(ZEN4, cap)
    assert (isa.level, isa.vnni, isa.native_bf16) == (level, vnni, bf16)
    assert "fma" in isa.flags and f"ONEDNN_MAX_CPU_ISA={cap}" in isa.summary()


@pytest.mark.parametrize("cap", [None, "", "ALL", "DEFAULT", "AVX10_2_512"])
def test_no_cap_or_one_the_probe_does_not_know_leaves_the_cpu_as_it_is(cap):
    assert cpu_isa.capped(ZEN4, cap) is ZEN4


def test_bfloat16_without_native_bf16_warns_with_the_measured_cost(fake_cpu):
    fake_cpu(AVX2_EPYC)
    warning = cpu_isa.dtype_warning("bfloat16")
    assert warning and "emulated" in warning and f"{cpu_isa.EMULATED_BF16_SLOWDOWN}x slower" in warning
    assert "--dtype float32" in warning and "AMD EPYC 7B13" in warning
    assert cpu_isa.dtype_warning("float16") and cpu_isa.dtype_warning("float32") is None

    fake_cpu(AMX)
    assert cpu_isa.dtype_warning("bfloat16") is None


@pytest.mark.parametrize(("isa", "warns"), [(AVX2_EPYC, True), (AVX512_BF16, False)])
def test_serving_bfloat16_logs_the_warning_at_start_up(isa, warns, fake_cpu, bundled_dir, caplog):
    fake_cpu(isa)
    # sdpa: the default (cpu_varlen) would load its kernel built for the faked CPU into this process.
    config = ModelConfig(path=str(bundled_dir), served_name="m", dtype="bfloat16", attention_backend="sdpa")
    with caplog.at_level(logging.INFO, logger="embedserv"):
        log_spec(read_served_model(config), config)

    assert f"CPU {isa.summary()}" in caplog.text  # the ISA is always logged
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "bfloat16" in r.getMessage()]
    assert bool(warnings) == warns


def test_constants_follow_the_isa(fake_cpu):
    fake_cpu(AVX2_EPYC)
    assert cpu_isa.int8_levels() == (63, 255)
    assert not cpu_isa.bf16_matmul_attention(1000, 4096)  # emulated: the flash kernel always
    assert ModelConfig(path="m", served_name="m").batch_token_budget == cpu_isa.cpu_batch_tokens()
    fake_cpu(AMX)
    assert cpu_isa.int8_levels() == (127, 255)
    assert not cpu_isa.bf16_matmul_attention(1000, 4096)  # the flash kernel measured faster on AMX
    fake_cpu(AVX512_BF16)
    assert cpu_isa.bf16_matmul_attention(1, 64) and not cpu_isa.bf16_matmul_attention(1, 63)
    # Shorter runs from 32 tokens when they hold 128 tokens or more.
    assert cpu_isa.bf16_matmul_attention(4, 32) and not cpu_isa.bf16_matmul_attention(3, 32)
    assert not cpu_isa.bf16_matmul_attention(100, 31)
    assert ModelConfig(path="m", served_name="m", max_batch_tokens=100).batch_token_budget == 100


@pytest.mark.parametrize(("isa", "matmuls"), [(AVX2_EPYC, False), (AVX512_BF16, True), (AMX, False)])
def test_bfloat16_attention_on_either_path_matches_float32(isa, matmuls, fake_cpu):
    """On an AVX-512-bf16 CPU long runs take the two-matmul path, elsewhere (bf16 emulated; AMX, where the flash
    kernel measured faster) SDPA's kernel: both compute the same attention (compared with float32 SDPA, at
    bfloat16's tolerance)."""
    fake_cpu(isa)
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 96, 32) for _ in range(3))
    assert sdpa._uses_matmuls(q.bfloat16(), 96) == matmuls

    got = sdpa._attend_batched(32**-0.5, q.bfloat16(), k.bfloat16(), v.bfloat16(), False, False, None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    ("isa", "activations"),
    [
        (AVX2_EPYC, "float32"),
        (AVX512_ONLY, "float32"),
        (AVX512_BF16, "bfloat16"),
        (AMX, "bfloat16"),
    ],
)
def test_int8_activations_are_bfloat16_only_where_it_is_native(isa, activations, fake_cpu):
    fake_cpu(isa)
    assert cpu_isa.int8_activation_dtype() == activations
    assert ModelConfig(path="m", served_name="m", quantization="int8").torch_dtype_name == activations


def test_fusion_is_compiled_where_a_compiler_is_and_eager_otherwise(fake_cpu, monkeypatch):
    for isa in (AVX2_EPYC, AVX512_ONLY, AVX512_BF16, AMX):
        fake_cpu(isa)
        monkeypatch.setattr(cpu_isa, "cxx_compiler", lambda: "g++")
        assert cpu_isa.fusion("auto") == ("compiled", "inductor with g++")
        mode, why = cpu_isa.fusion("eager")
        assert mode == "eager" and "--cpu-fusion eager" in why
        monkeypatch.setattr(cpu_isa, "cxx_compiler", lambda: None)
        for requested in ("auto", "compiled"):
            mode, why = cpu_isa.fusion(requested)
            assert mode == "eager" and "no C++ compiler" in why
    with pytest.raises(ValueError, match="auto, compiled, eager"):
        cpu_isa.fusion("fast")


def test_the_compiler_is_found_from_cxx_first(monkeypatch, tmp_path):
    compiler = tmp_path / "my-c++"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CXX", "my-c++")
    assert cpu_isa.cxx_compiler() == "my-c++"
    monkeypatch.delenv("CXX")
    assert cpu_isa.cxx_compiler() is None  # nothing else on this PATH
