"""Which int8 levels, per kind of linear, keep a model closest to float32: cosine of each text's vector.

    ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=. python benchmarks/int8_layers.py [--model DIR] [--texts 200]
        [--schemes "63/255;127/127;ffn_out=float;ffn_out=127/127"]

A scheme is `W/A` (every linear's weight levels and activation levels), or `KIND=W/A` / `KIND=float` (that kind
of linear, by the end of its module name: qkv, attn_out, ffn_in, ffn_out for BERT; the rest on cpu_isa's
levels). Everything runs in this process: float32 once, then one int8 engine per scheme over the same real
texts (benchmarks/corpus.py), the quantize steps eager (the same math as compiled). oneDNN reads
ONEDNN_MAX_CPU_ISA once per process: set it to run this CPU as one without VNNI (cpu_isa reads it too).
Prints a markdown table with the CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from torch import nn

import embedserv.worker.replica as replica
from benchmarks.corpus import stdlib_texts
from embedserv import cpu_isa
from embedserv.config import ModelConfig, bundled_model_path
from embedserv.engine.sync import SyncEngine
from embedserv.models.layers import Linear
from embedserv.types import EmbedParams


def levels_of(scheme: str, name: str) -> tuple[int, int] | None:
    """The (weight, activation) levels `scheme` gives the linear called `name`; None keeps it float."""
    choice = None
    for part in scheme.split(","):
        kind, _, value = part.rpartition("=")
        if not kind or name.endswith(kind):
            choice = value
    if choice is None:
        return cpu_isa.int8_levels()
    if choice == "float":
        return None
    weights, _, activations = choice.partition("/")
    return int(weights), int(activations)


def embed(model: str, texts: list[str], scheme: str | None) -> np.ndarray:
    def quantize(module: nn.Module, *_levels) -> None:
        for name, linear in module.named_modules():
            levels = levels_of(scheme, name) if isinstance(linear, Linear) else None
            if levels is not None:
                linear.quantize_int8(*levels)

    replica.quantize_linears = quantize  # what build_runner calls with --quantization int8
    quantization = None if scheme is None else "int8"
    config = ModelConfig(path=model, served_name="m", quantization=quantization, cpu_fusion="eager")
    engine = SyncEngine(config)
    try:
        return engine.embed(texts, EmbedParams(truncate=True)).embeddings
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(bundled_model_path()))
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--schemes", default="63/255;127/127;127/255")
    args = parser.parse_args()
    texts = stdlib_texts(args.texts, seed=0)
    reference = embed(args.model, texts, None)
    print(f"# {cpu_isa.detect().summary()}; {Path(args.model).name}, {len(texts)} texts, cosine to float32\n")
    print("| scheme | min cosine | mean cosine |\n|---|---:|---:|")
    for scheme in args.schemes.split(";"):
        cosines = np.sum(reference * embed(args.model, texts, scheme), axis=1)
        print(f"| {scheme} | {cosines.min():.4f} | {cosines.mean():.4f} |", flush=True)


if __name__ == "__main__":
    main()
