"""--quantization int8: a linear's weight in int8, its activations quantized per token, on oneDNN.

A Linear whose weight is quantized (`Linear.quantize_int8`) runs three steps:

1. `quantize_rows`: each row of x onto [0, 255] by its own minimum and range (uint8). Per-token ranges make
   a row's result independent of the rows batched with it, and asymmetric rows use all 256 levels where
   activations are one-sided (after GELU): MiniLM's lowest cosine to float32 on 200 real texts went from
   0.985 (symmetric, 7 bits) to 0.995.
2. oneDNN's int8 matmul of those bytes by the int8 weight (one scale per output channel): exact integer
   products, scaled back by the weight's scales (oneDNN takes one activation scale per call: 1 / 255).
   Without VNNI the weights get 7 bits (cpu_isa.int8_levels): oneDNN's 16-bit pair sums saturate for 8 bits
   both. Activations on [0, 127] are the other exact choice (`activation_levels`); it measured lower there.
3. `dequantize`: `out[i] = spread[i] * out[i] + low[i] * rowsum(W) + bias`, then the linear's activation,
   then its residual, then the activations' dtype (float32, or bfloat16 where cpu_isa says).

Steps 1 and 3 are memory-bound passes over the rows; eagerly they are six to nine passes (amin, amax,
addcmul, a cast; mul, a rank-2 addmm, the activation, the add, a cast) and took more of int8's time than
its matmuls (docs/performance-history.md, issue 33). Compiled by inductor each is one C++ loop over the rows
(`Fused`), where a C++ compiler is present; without one, or with `--cpu-fusion eager`, they run eagerly,
and the start-up log says which. Either way a row's result depends only on that row (row-wise reductions,
element-wise epilogues, exact integer products), so vectors do not depend on their batch.
"""

from __future__ import annotations

import logging
import threading
import types

import torch

logger = logging.getLogger(__name__)

_TINY = torch.finfo(torch.float32).tiny


def _quantize_rows(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = x.float()
    # amin and amax, not aminmax: 8x slower on 1536-wide rows eagerly.
    low = rows.amin(dim=1, keepdim=True)
    spread = (rows.amax(dim=1, keepdim=True) - low).clamp_min(_TINY)
    inverse = levels / spread
    # (x - low) * levels / spread + 0.5 lies in [0.5, levels + 0.5]: truncating to uint8 rounds it, one pass less.
    return torch.addcmul(0.5 - low * inverse, rows, inverse).to(torch.uint8), low, spread


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows, k] -> (uint8 [rows, k], low [rows, 1], spread [rows, 1]), both float32, with
    x ~= q / 255 * spread + low."""
    return _quantize_rows(x, 255)


def quantize_rows_7bit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_rows onto [0, 127]: x ~= q / 127 * spread + low."""
    return _quantize_rows(x, 127)


def dequantize(
    out: torch.Tensor,
    low: torch.Tensor,
    spread: torch.Tensor,
    terms: torch.Tensor,
    activation,
    residual: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Step 3: `terms` is [2, n]: the weight as the int8 matmul sees it summed per output, and the bias.
    `activation` is a function of one tensor or None."""
    out = out * spread + (low * terms[0] + terms[1])
    if activation is not None:
        out = activation(out)
    if residual is not None:
        out = out + residual
    return out.to(dtype)


def _dequantize_eager(out, low, spread, terms, activation, residual, dtype):
    """dequantize in place: the rank-2 update as one addmm instead of two broadcasts."""
    out = out.mul_(spread).addmm_(torch.cat([low, torch.ones_like(low)], dim=1), terms)
    if activation is not None:
        out = activation(out)
    if residual is not None:
        out = out.add_(residual)
    return out.to(dtype)


class Fused:
    """`function` compiled by inductor (one C++ kernel per graph), or eager where that is off or fails.

    One compiled entry per variant a process runs (activation, residual or not, dtype), each compiled from
    its own copy of the function's code: dynamo counts recompilations per code object and past 8 would
    give up on them. Sizes are dynamic: a new row count compiles nothing. A compile that fails (no C++
    compiler, an unsupported op) is logged once, and that step runs eagerly from then on."""

    _lock = threading.Lock()
    enabled = False  # set by configure(); eager until a replica asks for compiled kernels

    def __init__(self, name: str, compiled, eager) -> None:
        self.name, self._source, self._eager = name, compiled, eager
        self._variants: dict = {}
        self.failed = False

    def __call__(self, variant, *args):
        if not Fused.enabled or self.failed:
            return self._eager(*args)
        run = self._variants.get(variant)
        if run is None:
            with Fused._lock:
                _compile_in_process()
                compiled = torch.compile(_copy(self._source), dynamic=True, fullgraph=True)
                run = self._variants.setdefault(variant, compiled)
        try:
            return run(*args)
        except Exception as exc:
            self.failed = True
            cause = exc
            while cause.__cause__ is not None:
                cause = cause.__cause__
            logger.warning(
                "int8 %s: compiled kernel unavailable (%s: %s); running it eagerly",
                self.name,
                type(cause).__name__,
                (str(cause).strip().splitlines() or [""])[-1][:300],
            )
            logger.debug("int8 %s: the compile failed", self.name, exc_info=exc)
            return self._eager(*args)


def _compile_in_process() -> None:
    """gcc runs from this process, without a pool of compile worker processes next to the server's
    (a precaution: kernels this small compile in seconds, once per machine, and inductor caches them)."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1


def _copy(function: types.FunctionType) -> types.FunctionType:
    """`function` with a code object of its own."""
    return types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )


_QUANTIZE = {
    255: Fused("quantize", quantize_rows, quantize_rows),
    127: Fused("quantize (7 bits)", quantize_rows_7bit, quantize_rows_7bit),
}
_DEQUANTIZE = Fused("dequantize", dequantize, _dequantize_eager)


def configure(compiled: bool) -> None:
    """Process-wide: the fused int8 steps compiled (True) or eager (False)."""
    Fused.enabled = compiled


class Int8Weight:
    """A linear's weight as int8 with one scale per output channel, in oneDNN's packed layout."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, levels: int, activation_levels: int = 255
    ) -> None:
        if activation_levels not in _QUANTIZE:
            raise ValueError(f"activations are quantized onto 255 or 127 levels, not {activation_levels}")
        weight = weight.float()
        self.scales = (weight.abs().amax(dim=1) / levels).clamp_min(_TINY)
        quantized = torch.round(weight / self.scales[:, None]).clamp_(-levels, levels).to(torch.int8)
        self.packed = torch.ops.onednn.qlinear_prepack(quantized, None)
        self.zero_points = torch.zeros(weight.shape[0], dtype=torch.int32)
        # [2, out]: the weight as the int8 matmul sees it summed per output (times each row's minimum),
        # and the bias (times one).
        sums = (quantized.float() * self.scales[:, None]).sum(dim=1)
        bias = bias.detach().float() if bias is not None else torch.zeros_like(sums)
        self.terms = torch.stack([sums, bias])
        self.levels, self.activation_levels = levels, activation_levels
        self._quantize = _QUANTIZE[activation_levels]

    def product(self, q: torch.Tensor) -> torch.Tensor:
        """oneDNN's int8 matmul of quantized rows: float32 `q / activation_levels @ (int8 W * scales).T`."""
        return torch.ops.onednn.qlinear_pointwise(
            q,
            1 / self.activation_levels,
            0,
            self.packed,
            self.scales,
            self.zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )

    def matmul(self, x: torch.Tensor, activation=None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`activation(x @ W.T + bias) + residual`, in x's dtype."""
        rows = x.reshape(-1, x.shape[-1])
        q, low, spread = self._quantize(x.dtype, rows)
        flat_residual = None if residual is None else residual.reshape(-1, residual.shape[-1])
        variant = (activation, residual is None, x.dtype)
        out = _DEQUANTIZE(variant, self.product(q), low, spread, self.terms, activation, flat_residual, x.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])
