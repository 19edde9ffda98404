"""Inputs per second of a Qwen2-VL-shaped embedder (GME / DSE style: an image with text after it, the last token's
state) on image + text inputs: embedserv's engine in process against transformers' Qwen2VLModel in process.

    python benchmarks/vl_embed_throughput.py [--inputs 32] [--batch 8] [--rounds 3] [--threads N]
        [--shape small] [--out benchmarks/results/vl_embed/DATE-ISA.json]

The model is random weights (seeded) in a scaled-down but realistic shape (--shape: `small`, a 768-wide 4-layer
decoder under a 4-block 384-wide vision tower; `tiny`, for a quick check), built like the tests build theirs
(tests/helpers/qwen_vl_models.py), float32 on the CPU. The inputs are N encoded images of mixed sizes (224x224 up
to 448x336, PNG and JPEG) each with a text after it, framed as GME's gme_inference.py frames them (system
instruction "You are a helpful assistant.", the user turn with the image's placeholders then the text, the
assistant turn opened, <|endoftext|> pooled).

Both runners do the whole job from the same bytes and texts: decode, resize, normalize, tokenize, the vision
tower, the decoder, the last token, L2 normalization. Ours is SyncEngine (images prepared in its tokenizer pool,
calls of --batch inputs all in flight, packed by its scheduler); transformers is the image processor and the
tokenizer on each --batch (prompts left-padded, image pads expanded as Qwen2VLProcessor does) through the
checkpoint's Qwen2VLModel, the last column's state per row. Before timing, every row of ours is checked against
transformers' (cosine). Rounds alternate between the runners; the best counts (a shared machine drifts).
Prints a markdown table with the CPU and writes the JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.peer_runners.common import cpu_info
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams, ImageInput
from tests.helpers.qwen_vl_models import DEFAULT_INSTRUCTION, framed
from tests.helpers.vision_language_models import _qwen_tokenizer, page_image, qwen_text_config, qwen_vision_token_ids

ROOT = Path(__file__).resolve().parents[1]
# (height, width) of the images, cycled: every side a multiple of 28 (one merged 2 x 2 block of 14-pixel patches).
SIZES = ((224, 224), (336, 448), (224, 336), (448, 336), (280, 280), (336, 224))
TEXTS = (
    "What does this chart say about revenue in 2023?",
    "Find the invoice total.",
    "A slide about the quarterly roadmap and its milestones for the platform team",
    "Which figure shows the error rate?",
)
# The text decoder's and the vision tower's sizes (M-RoPE's sections split head_dim / 2 rotary frequencies).
SHAPES = {
    "small": {
        "text": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
                     num_key_value_heads=2, mrope_section=[8, 12, 12]),
        "vision": dict(embed_dim=384, depth=4, num_heads=6),
    },
    "tiny": {
        "text": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, mrope_section=[2, 3, 3]),
        "vision": dict(embed_dim=32, depth=2, num_heads=4),
    },
}  # fmt: skip


def build_model(out: Path, shape: str, seed: int = 0) -> Path:
    """A random Qwen2VLForConditionalGeneration of `shape` with its tokenizer and image processor (images kept at
    their size between 56x56 and 448x448 pixels)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if (out / "config.json").exists():
        return out
    text = dict(SHAPES[shape]["text"])
    tokenizer = _qwen_tokenizer(out)
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": text.pop("mrope_section")}
    text = qwen_text_config(
        tokenizer, **text, max_position_embeddings=4096, initializer_range=0.02, rope_parameters=rope
    )
    vision = dict(
        SHAPES[shape]["vision"], hidden_size=text["hidden_size"], mlp_ratio=4, patch_size=14, temporal_patch_size=2,
        spatial_merge_size=2, initializer_range=0.02,
    )  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **qwen_vision_token_ids(tokenizer))
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(str(out), safe_serialization=True)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448).save_pretrained(str(out))
    return out


def make_inputs(count: int) -> list[ImageInput]:
    out = []
    for i in range(count):
        height, width = SIZES[i % len(SIZES)]
        data = page_image(height, width, seed=i, fmt="JPEG" if i % 2 else "PNG")
        out.append(ImageInput(data, TEXTS[i % len(TEXTS)]))
    return out


class Ours:
    def __init__(self, path: Path, batch: int) -> None:
        self.engine = SyncEngine(ModelConfig(path=str(path), served_name="bench", dtype="float32"))
        self.batch = batch

    def run(self, inputs: list[ImageInput]) -> np.ndarray:
        calls = [inputs[i : i + self.batch] for i in range(0, len(inputs), self.batch)]
        results = self.engine.embed_concurrently(calls, EmbedParams(normalize=True))
        return np.concatenate([r.embeddings for r in results])

    def close(self) -> None:
        self.engine.close()


class Transformers:
    """Qwen2VLProcessor's work done by hand (it also wants a video processor, which needs torchvision): the image
    processor on the batch's images, each image's one <|image_pad|> repeated t * h * w / merge**2 times, the
    framed prompts tokenized left-padded; then Qwen2VLModel and the last column."""

    def __init__(self, path: Path, batch: int) -> None:
        from transformers import AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.model = AutoModelForImageTextToText.from_pretrained(str(path), dtype="float32").eval().model
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), padding_side="left")
        self.images = Qwen2VLImageProcessorPil.from_pretrained(str(path))
        self.pad_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.batch = batch

    def _batch(self, inputs: list[ImageInput]) -> dict:
        from PIL import Image

        pictures = [Image.open(io.BytesIO(item.data)).convert("RGB") for item in inputs]
        batch = dict(self.images(images=pictures, return_tensors="pt"))
        counts = (batch["image_grid_thw"].prod(-1) // self.images.merge_size**2).tolist()
        prompts = [
            framed(item.text, image=True, instruction=DEFAULT_INSTRUCTION).replace("<|image_pad|>", "<|image_pad|>" * n)
            for item, n in zip(inputs, counts, strict=True)
        ]
        batch.update(self.tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt"))
        batch["mm_token_type_ids"] = (batch["input_ids"] == self.pad_id).int()
        return batch

    @torch.inference_mode()
    def run(self, inputs: list[ImageInput]) -> np.ndarray:
        out = []
        for i in range(0, len(inputs), self.batch):
            hidden = self.model(**self._batch(inputs[i : i + self.batch])).last_hidden_state[:, -1]
            out.append(torch.nn.functional.normalize(hidden, dim=-1).numpy())
        return np.concatenate(out)

    def close(self) -> None:
        pass


def bench(path: Path, inputs: list[ImageInput], batch: int, rounds: int) -> dict:
    runners = {"ours": Ours(path, batch), "transformers": Transformers(path, batch)}
    try:
        vectors = {name: runner.run(inputs) for name, runner in runners.items()}  # warm-up and the check
        cosines = np.sum(vectors["ours"] * vectors["transformers"], axis=1)
        if cosines.min() < 0.9999:
            raise SystemExit(f"ours differs from transformers: min cosine {cosines.min():.6f}")
        # The check means something only if the rows differ: the largest cosine between two different inputs.
        between = vectors["transformers"] @ vectors["transformers"].T
        distinct = float(between[~np.eye(len(inputs), dtype=bool)].max()) if len(inputs) > 1 else float("nan")
        best = {name: float("inf") for name in runners}
        for _ in range(rounds):
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.run(inputs)
                best[name] = min(best[name], time.perf_counter() - start)
    finally:
        for runner in runners.values():
            runner.close()
    return {"seconds": best, "min_cosine": float(cosines.min()), "max_cosine_between_inputs": distinct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shape", choices=SHAPES, default="small")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "embedserv-vl-bench"))
    parser.add_argument("--out", default=None, help="the JSON's path (default under benchmarks/results/vl_embed/)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = build_model(Path(args.cache) / f"qwen2-vl-{args.shape}", args.shape)
    inputs = make_inputs(args.inputs)
    # Other work on the machine slows both runners unevenly: say how loaded it was.
    load_before = os.getloadavg()[0]
    result = bench(path, inputs, args.batch, args.rounds)
    load = (load_before, os.getloadavg()[0])
    name, flags = cpu_info()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    rates = {runner: args.inputs / seconds for runner, seconds in result["seconds"].items()}
    sizes = sorted({f"{w}x{h}" for h, w in SIZES[: args.inputs]})
    print(
        f"CPU: {name} ({' '.join(isa)}); torch {torch.__version__}, {torch.get_num_threads()} threads; shape "
        f"{args.shape}; {args.inputs} image + text inputs ({', '.join(sizes)}), batches of {args.batch}, best of "
        f"{args.rounds}; min cosine ours vs transformers {result['min_cosine']:.6f} (between two inputs at most "
        f"{result['max_cosine_between_inputs']:.4f}); 1-minute load average {load[0]:.1f} before, {load[1]:.1f} "
        f"after, on {os.cpu_count()} CPUs\n"
    )
    print("| runner | inputs/s | vs transformers |")
    print("|---|---:|---:|")
    for runner, rate in rates.items():
        print(f"| {runner} | {rate:.2f} | {rate / rates['transformers']:.2f}x |")
    record = {
        "cpu": name,
        "isa": isa,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": {"name": args.shape, **SHAPES[args.shape]},
        "inputs": args.inputs,
        "image_sizes": sizes,
        "batch": args.batch,
        "rounds": args.rounds,
        "min_cosine": result["min_cosine"],
        "max_cosine_between_inputs": result["max_cosine_between_inputs"],
        "cpus": os.cpu_count(),
        "load_average_1m": {"before": load[0], "after": load[1]},
        "inputs_per_s": rates,
        "ratio_vs_transformers": rates["ours"] / rates["transformers"],
    }
    isa_name = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "cpu"
    out = Path(
        args.out or ROOT / "benchmarks" / "results" / "vl_embed" / f"{date.today()}-{isa_name}-{args.shape}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
