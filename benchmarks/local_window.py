"""What ModernBERT's local-attention layers cost on the CPU sdpa backend, against its global layers.

A ModernBERT-base-shaped layer (hidden 768, 12 heads, GeGLU 1152, local_attention 128: each token sees 64
on each side) with random weights, timed at 512 and 2048 tokens (one sequence, float32): the attention
kernel alone and the whole layer (norms, projections, MLP), as a global layer and as a local one, and a
model of `--layers` layers (every third global, as published) against the same model all global.
A local layer that costs what its window costs runs its attention in about window / length of a global
one's time; one that masks the full square costs as much as a global layer.

    PYTHONPATH=. python benchmarks/local_window.py [--lengths 512 2048] [--layers 6] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from embedserv.attention.backends.sdpa import SdpaBackend
from embedserv.attention.metadata import build_common_metadata
from embedserv.forward_context import set_forward_context
from embedserv.models.families.modernbert import ModernBertModel
from embedserv.worker.layer_routes import forward_context_for


def _config(num_layers: int, every: int):
    from transformers import ModernBertConfig

    return ModernBertConfig(
        num_hidden_layers=num_layers,
        global_attn_every_n_layers=every,
        max_position_embeddings=8192,
    )


def _model(num_layers: int, every: int) -> ModernBertModel:
    torch.manual_seed(0)
    model = ModernBertModel(_config(num_layers, every)).eval().requires_grad_(False)
    for param in model.parameters():
        param.data.normal_(0.0, 0.02) if param.dim() > 1 else param.data.fill_(1.0)
    for module in model.modules():
        if hasattr(module, "pack"):
            module.pack()
    return model


def _best_ms(fn, repeats: int) -> float:
    fn()  # warm-up: oneDNN primitives, rotary tables, masks
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def _context(model, length: int):
    backend = SdpaBackend()
    metadata = backend.build_metadata(build_common_metadata(np.array([length]), is_causal=False))
    return forward_context_for(model, backend, metadata)


def time_length(length: int, num_layers: int, repeats: int) -> dict[str, float]:
    hidden = torch.randn(length, 768)
    positions = torch.arange(length)
    ids = torch.randint(0, 50_000, (length,))
    mixed, every_global = _model(num_layers, 3), _model(num_layers, 1)
    global_layer, local_layer = mixed.layers[0], mixed.layers[1]
    assert local_layer.attn.attn.sliding_window == 65 and global_layer.attn.attn.sliding_window is None
    tables = {kind: rotary(positions) for kind, rotary in mixed.rotary.items()}
    q = torch.randn(length, 768)
    k, v = torch.randn_like(q), torch.randn_like(q)
    row = {}
    with torch.inference_mode(), set_forward_context(_context(mixed, length)):
        row["attn global ms"] = _best_ms(lambda: global_layer.attn.attn(q, k, v), repeats)
        row["attn local ms"] = _best_ms(lambda: local_layer.attn.attn(q, k, v), repeats)
        row["layer global ms"] = _best_ms(lambda: global_layer(hidden, *tables["full_attention"]), repeats)
        row["layer local ms"] = _best_ms(lambda: local_layer(hidden, *tables["sliding_attention"]), repeats)
        row["mixed tok/s"] = length / _best_ms(lambda: mixed(ids, positions), repeats) * 1000
    with torch.inference_mode(), set_forward_context(_context(every_global, length)):
        row["all-global tok/s"] = length / _best_ms(lambda: every_global(ids, positions), repeats) * 1000
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--layers", type=int, default=6, help="model depth for tokens/s (every third global)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, one sequence per step")
    rows = {length: time_length(length, args.layers, args.repeats) for length in args.lengths}
    columns = list(next(iter(rows.values())))
    print("tokens | " + " | ".join(columns) + " | local/global attn")
    for length, row in rows.items():
        ratio = row["attn local ms"] / row["attn global ms"]
        print(f"{length:6d} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + f" | {ratio:.2f}")


if __name__ == "__main__":
    main()
