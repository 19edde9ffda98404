"""Attention backends against each other, and packed against padded, on several length mixes.

    PYTHONPATH=. python benchmarks/attention_backends.py [--device cpu|cuda] [--repeats 10]

For each length mix, dtype and attention kind it times one attention layer over the packed batch with
every backend that can run on the device, plus the padded baseline the reference libraries use: one
SDPA call over [batch, heads, longest, head_size] with a key-padding mask. A model builds the attention
metadata once per batch and runs it in every layer, so each figure is one layer's forward plus 1/6 of
the metadata build (a 6-layer model like all-MiniLM-L6-v2). Best of `--repeats`, microseconds.
Prints markdown.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata, cumulative_offsets
from embedserv.attention.selector import AttentionSpec, backend_class, unsupported_reason
from embedserv.config import ATTENTION_BACKENDS
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for

LAYERS = 6


def length_mixes(rng: np.random.Generator) -> dict[str, list[int]]:
    return {
        "64 x 16 (short queries)": [16] * 64,
        "32 x 128 (equal)": [128] * 32,
        "8 x 512 (long)": [512] * 8,
        # A long tail like real documents: most short, some truncated at 256.
        "96 mixed 4..256": sorted(np.minimum(rng.geometric(1 / 40, 96) + 3, 256).tolist(), reverse=True),
    }


# (label, heads, kv heads, head size, causal): an encoder embedder and a small GQA decoder embedder.
SHAPES = [
    ("MiniLM-like encoder", 12, 12, 32, False),
    ("GQA decoder", 16, 4, 64, True),
]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_us(fn, device: torch.device, repeats: int) -> float:
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def packed_us(name, lens, heads, kv_heads, head_size, causal, dtype, device, repeats) -> float:
    tokens = sum(lens)
    q = torch.randn(tokens, heads * head_size, dtype=dtype, device=device)
    k, v = (torch.randn(tokens, kv_heads * head_size, dtype=dtype, device=device) for _ in range(2))
    layer = Attention(heads, head_size, num_kv_heads=kv_heads)
    backend = backend_class(name)()
    cu = torch.from_numpy(cumulative_offsets(np.array(lens))).to(device)
    common = build_common_metadata(np.array(lens), causal, cu_seqlens=cu)

    def metadata():
        return backend.build_metadata(common)

    context = forward_context_for([layer], backend, metadata())

    def forward():
        with set_forward_context(context):
            layer(q, k, v)

    return best_us(forward, device, repeats) + best_us(metadata, device, repeats) / LAYERS


def padded_us(lens, heads, kv_heads, head_size, causal, dtype, device, repeats) -> float:
    """What a padded batch costs: pad to the longest, mask the padding keys, one SDPA call."""
    batch, longest = len(lens), max(lens)
    q = torch.randn(batch, heads, longest, head_size, dtype=dtype, device=device)
    k, v = (torch.randn(batch, kv_heads, longest, head_size, dtype=dtype, device=device) for _ in range(2))
    valid = torch.arange(longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    mask = valid[:, None, None, :]
    if causal:
        mask = mask & torch.ones(longest, longest, dtype=torch.bool, device=device).tril()

    def forward():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)

    return best_us(forward, device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtypes", default=None, help="comma-separated; default float32,bfloat16")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtypes = [getattr(torch, d) for d in (args.dtypes or "float32,bfloat16").split(",")]
    mixes = length_mixes(np.random.default_rng(0))
    names = [n for n in ATTENTION_BACKENDS if n != "naive"]
    print(
        f"# torch {torch.__version__}, device {device}"
        f" ({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'})"
        f", best of {args.repeats}, us per layer (+1/{LAYERS} metadata); - = cannot run here"
    )
    print("| shape | dtype | length mix | tokens | padded SDPA | " + " | ".join(names) + " | fastest |")
    print("|---|---|---|---:|---:|" + "---:|" * len(names) + "---|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for label, heads, kv_heads, head_size, causal in SHAPES:
            for dtype in dtypes:
                spec = AttentionSpec(device, dtype, head_size, heads, kv_heads, causal)
                for mix, lens in mixes.items():
                    times = {
                        "padded SDPA": padded_us(lens, heads, kv_heads, head_size, causal, dtype, device, args.repeats)
                    }
                    for name in names:
                        if unsupported_reason(name, spec) is None:
                            times[name] = packed_us(
                                name, lens, heads, kv_heads, head_size, causal, dtype, device, args.repeats
                            )
                    cells = " | ".join(f"{times[n]:.0f}" if n in times else "-" for n in names)
                    print(
                        f"| {label} | {str(dtype).removeprefix('torch.')} | {mix} | {sum(lens)} "
                        f"| {times['padded SDPA']:.0f} | {cells} | {min(times, key=times.get)} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
