"""--quantization int8: int8 linears on CPU, per-token activation and per-channel weight scales.

The int8 product must be exact integer arithmetic (no saturation on CPUs without VNNI), the model must
stay close to float32 on real texts, a text's vector must not depend on its batch, and what int8 does
not serve is refused at start-up. Each holds with the quantize / dequantize steps compiled by inductor
and eager (models/int8.py), and with the activations in float32 and in the CPU's auto dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.corpus import stdlib_texts
from embedserv import cpu_isa
from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.models import int8 as int8_module
from embedserv.models.int8 import Int8Weight
from embedserv.models.layers import Linear
from embedserv.models.loading.spec_reader import read_model_spec
from embedserv.types import EmbedParams


@pytest.fixture(params=["compiled", "eager"])
def fusion(request, monkeypatch):
    """Runs a test with int8's quantize / dequantize steps compiled (where a C++ compiler is) and eager."""
    if request.param == "compiled" and cpu_isa.cxx_compiler() is None:
        pytest.skip("no C++ compiler for inductor here")
    monkeypatch.setattr(int8_module.Fused, "enabled", request.param == "compiled")
    return request.param


def _exact(float_weight: torch.Tensor, levels: tuple[int, int], x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What Int8Weight.matmul must give: the same integers (rounded in float32 as it rounds them), their
    products summed exactly (float64 holds these sums exactly), mapped back."""
    weight_levels, activation_levels = levels
    low = x.amin(dim=1, keepdim=True)
    spread = x.amax(dim=1, keepdim=True) - low
    q = torch.addcmul(0.5 - low * (activation_levels / spread), x, activation_levels / spread).floor().double()
    scales = float_weight.abs().amax(dim=1) / weight_levels
    w = torch.round(float_weight / scales[:, None]).double() * scales.double()[:, None]
    return (q / activation_levels * spread.double()) @ w.T + low.double() @ w.sum(dim=1)[None, :] + bias.double()


@pytest.mark.parametrize(
    "levels", [(63, 255), (127, 127), pytest.param((127, 255), id="8-bit-both-needs-vnni")], ids=str
)
def test_the_int8_product_is_exact_integer_arithmetic(levels, fusion):
    """Rows of very different scales and offsets; 384 -> 1536 as in MiniLM's FFN. On a CPU without VNNI,
    8-bit weights and activations saturate oneDNN's 16-bit pair sums: either on 7 bits is exact
    (test_int8_without_vnni.py runs this CPU as one without VNNI)."""
    if levels == (127, 255) and not cpu_isa.detect().vnni:
        pytest.skip(f"8 bits both are used only with VNNI; this CPU: {cpu_isa.detect().summary()}")
    torch.manual_seed(0)
    x = torch.randn(300, 384) * torch.rand(300, 1) * 10 + torch.randn(300, 1)
    float_weight = torch.randn(1536, 384) * 0.05
    bias = torch.randn(1536)

    got = Int8Weight(float_weight, bias, *levels).matmul(x)

    torch.testing.assert_close(got.double(), _exact(float_weight, levels, x, bias), rtol=1e-5, atol=1e-4)
    cosine = torch.nn.functional.cosine_similarity(got, torch.nn.functional.linear(x, float_weight, bias), dim=1)
    assert cosine.min() > 0.999


def test_an_int8_linear_keeps_its_activation_and_residual_and_drops_the_float_weight(fusion):
    torch.manual_seed(1)
    gelu, plain = Linear(64, 128, activation="gelu"), Linear(128, 64)
    for linear in (gelu, plain):
        torch.nn.init.normal_(linear.weight, std=0.05)
        torch.nn.init.normal_(linear.bias)
    x, residual = torch.randn(20, 64), torch.randn(20, 64)
    expected = plain(gelu(x), residual=residual)

    for linear in (gelu, plain):
        linear.quantize_int8(*cpu_isa.int8_levels())
    got = plain(gelu(x), residual=residual)

    assert gelu.weight.numel() == 0 and plain.weight.numel() == 0
    assert torch.nn.functional.cosine_similarity(got, expected, dim=1).min() > 0.999


# Where the CPU's auto choice is float32 (no native bfloat16: AVX2) a float32 case would repeat it exactly.
_ACTIVATIONS = ["auto"] if cpu_isa.int8_activation_dtype() == "float32" else ["float32", "auto"]


@pytest.fixture(scope="module", params=_ACTIVATIONS)
def minilm_pair(request, bundled_dir, engine_for):
    """float32 MiniLM and int8 MiniLM with float32 activations, or the CPU's auto choice (bfloat16 where
    native), with the steps as --cpu-fusion auto runs them here."""
    return engine_for(bundled_dir), engine_for(bundled_dir, quantization="int8", dtype=request.param)


def test_minilm_int8_stays_within_0_99_cosine_of_float32_on_real_texts(minilm_pair):
    """The documented accuracy: every one of 200 real texts of mixed length at cosine >= 0.99."""
    fp32, int8 = minilm_pair
    texts = stdlib_texts(200, seed=3)
    params = EmbedParams(truncate=True)
    a, b = fp32.embed(texts, params).embeddings, int8.embed(texts, params).embeddings

    cosines = np.sum(a * b, axis=1)  # both normalized
    assert cosines.min() >= 0.99, f"lowest cosine {cosines.min():.4f}"
    assert cosines.mean() >= 0.995, f"mean cosine {cosines.mean():.4f}"
    assert int8.info.dtype == "int8" and fp32.info.dtype == "float32"


def test_minilm_int8_gives_a_text_the_same_vector_alone_or_in_any_batch(minilm_pair):
    _, int8 = minilm_pair
    pool = stdlib_texts(40, seed=11)
    target, others = pool[0], pool[1:31]
    params = EmbedParams(truncate=True)

    alone = int8.embed([target], params).embeddings[0]
    for position in (0, 15, 30):
        batch = [*others[:position], target, *others[position:]]
        packed = int8.embed(batch, params).embeddings[position]
        np.testing.assert_allclose(packed, alone, rtol=0, atol=1e-6, err_msg=f"position {position}")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(device="cuda"), "runs on CPU"),
        (dict(device="cuda:1"), "runs on CPU"),
        (dict(dtype="float16"), "float32 or bfloat16"),
        (dict(quantization="int4"), "must be one of int8"),
        (dict(cpu_fusion="fast"), "must be one of auto, compiled, eager"),
    ],
)
def test_int8_is_refused_off_cpu_and_off_float32_or_bfloat16(kwargs, words):
    options = dict(quantization="int8") | kwargs
    with pytest.raises(ConfigError, match=words):
        ModelConfig(path="/nowhere", served_name="m", **options)


def test_int8_refuses_a_model_that_generates(tiny_generator):
    config = ModelConfig(path=str(tiny_generator("llama")), served_name="m", quantization="int8")
    with pytest.raises(ConfigError, match="generates text"):
        read_model_spec(config)


def test_the_flag_reaches_the_model_config():
    from embedserv.cli import build_parser, server_config

    config = server_config(build_parser().parse_args(["serve", "--model", "/m", "--quantization", "int8"]))
    assert config.models[0].quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int4"])


def test_compiled_and_eager_steps_agree_and_the_compiled_ones_ran(monkeypatch):
    """The fused kernels are the same math as the eager passes (up to float rounding), in float32 and
    bfloat16, with and without an activation and a residual; and they really were compiled, not fallen
    back from."""
    if cpu_isa.cxx_compiler() is None:
        pytest.skip("no C++ compiler for inductor here")
    torch.manual_seed(2)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    quantized = Int8Weight(weight, bias, *cpu_isa.int8_levels())
    x, residual = torch.randn(37, 64) * 3, torch.randn(37, 96)
    for dtype in (torch.float32, torch.bfloat16):
        for activation, res in ((None, None), (torch.nn.functional.gelu, None), (None, residual)):
            outs = {}
            for compiled in (False, True):
                monkeypatch.setattr(int8_module.Fused, "enabled", compiled)
                r = None if res is None else res.to(dtype)
                with torch.inference_mode():
                    outs[compiled] = quantized.matmul(x.to(dtype), activation, r)
            assert outs[True].dtype == dtype
            torch.testing.assert_close(outs[True].float(), outs[False].float(), rtol=1e-2, atol=2e-2)
    assert not any(step.failed for step in int8_module._QUANTIZE.values()) and not int8_module._DEQUANTIZE.failed
    assert int8_module._DEQUANTIZE._variants, "no compiled dequantize variant ran"


def test_a_compile_that_fails_falls_back_to_eager_and_says_so(monkeypatch, caplog):
    def broken(function, **_):
        def run(*args):
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

        return run

    step = int8_module.Fused("quantize", int8_module.quantize_rows, int8_module.quantize_rows)
    monkeypatch.setattr(int8_module.Fused, "enabled", True)
    monkeypatch.setattr(torch, "compile", broken)
    x = torch.randn(5, 16)
    with caplog.at_level("WARNING"):
        q, _low, _spread = step(torch.float32, x)
    expected = int8_module.quantize_rows(x)
    assert torch.equal(q, expected[0]) and step.failed
    assert "compiled kernel unavailable" in caplog.text and "InvalidCxxCompiler" in caplog.text


def test_int8_activations_follow_the_cpu_unless_a_dtype_is_given(monkeypatch):
    monkeypatch.setattr(cpu_isa, "int8_activation_dtype", lambda: "bfloat16")
    assert ModelConfig(path="/m", served_name="m", quantization="int8").torch_dtype_name == "bfloat16"
    assert ModelConfig(path="/m", served_name="m", quantization="int8", dtype="float32").torch_dtype_name == "float32"
    monkeypatch.setattr(cpu_isa, "int8_activation_dtype", lambda: "float32")
    assert ModelConfig(path="/m", served_name="m", quantization="int8").torch_dtype_name == "float32"
    assert ModelConfig(path="/m", served_name="m").torch_dtype_name == "float32"


def test_the_start_up_log_names_the_activations_and_the_fusion(bundled_dir, engine_for, caplog, request):
    if request.config.getoption("--data-parallel-size"):
        pytest.skip("the replica logs in its worker process")
    with caplog.at_level("INFO", logger="embedserv"):
        engine_for(bundled_dir, quantization="int8", dtype="float32", cpu_fusion="eager")
    expected = "int8 linears, activations in torch.float32; quantize and dequantize steps eager (--cpu-fusion eager)"
    assert expected in caplog.text
