"""Whether inductor should fuse LayerNorm into int8's dequantize step (and the next linear's quantize into both).

    python benchmarks/int8_epilogue.py [--rows 4096] [--widths 384,768] [--repeats 30]

A BERT layer's attention-output and FFN-output linears end in `LayerNorm(x @ W.T + b + residual)`, and the next
linear quantizes that LayerNorm's output again (models/int8.py). Per width, best of --repeats, in one process:

- separate: today's path: the compiled dequantize (with the residual), ATen's LayerNorm, the compiled quantize;
- dequantize+LayerNorm, then quantize: the first two as one inductor graph;
- all three as one inductor graph (it returns the normalized rows and the next linear's quantized ones).

All three are compiled as models/int8.py compiles its steps (dynamic sizes, one C++ loop per graph) on the
activations' dtype cpu_isa names. Prints markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from benchmarks.attention_kernels import best_us
from embedserv import cpu_isa
from embedserv.models.int8 import dequantize, quantize_rows

EPS = 1e-12


def _dequantize_norm(out, low, spread, terms, residual, weight, bias, dtype):
    rows = dequantize(out, low, spread, terms, None, residual, torch.float32)
    return F.layer_norm(rows, (rows.shape[-1],), weight, bias, EPS).to(dtype)


def _dequantize_norm_quantize(out, low, spread, terms, residual, weight, bias, dtype):
    rows = F.layer_norm(dequantize(out, low, spread, terms, None, residual, torch.float32), (out.shape[-1],),
                        weight, bias, EPS)  # fmt: skip
    return rows.to(dtype), *quantize_rows(rows)


def variants(rows: int, width: int, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    out, terms = torch.randn(rows, width), torch.randn(2, width)
    low, spread = torch.randn(rows, 1), torch.rand(rows, 1) + 0.5
    residual = torch.randn(rows, width).to(dtype)
    weight, bias = torch.rand(width) + 0.5, torch.randn(width) * 0.1
    weight_d, bias_d = weight.to(dtype), bias.to(dtype)
    compile_ = lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)  # noqa: E731
    deq, quant = compile_(dequantize), compile_(quantize_rows)
    deq_norm, deq_norm_quant = compile_(_dequantize_norm), compile_(_dequantize_norm_quantize)

    def separate():
        normed = F.layer_norm(deq(out, low, spread, terms, None, residual, dtype), (width,), weight_d, bias_d, EPS)
        return normed, quant(normed)

    def norm_fused():
        normed = deq_norm(out, low, spread, terms, residual, weight, bias, dtype)
        return normed, quant(normed)

    return {
        "separate (today)": separate,
        "dequantize+LayerNorm, then quantize": norm_fused,
        "all three in one graph": lambda: deq_norm_quant(out, low, spread, terms, residual, weight, bias, dtype),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--widths", default="384,768")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    dtype = getattr(torch, cpu_isa.int8_activation_dtype())
    widths = [int(w) for w in args.widths.split(",")]
    print(f"# {cpu_isa.detect().summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.rows} rows, activations {dtype}, best of {args.repeats}\n")  # fmt: skip
    print("| path | " + " | ".join(f"{w} wide, us" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    timings: dict[str, list[float]] = {}
    for width in widths:
        for name, run in variants(args.rows, width, dtype).items():
            timings.setdefault(name, []).append(best_us(run, args.repeats))
    for name, values in timings.items():
        print(f"| {name} | " + " | ".join(f"{v:.0f}" for v in values) + " |")


if __name__ == "__main__":
    main()
