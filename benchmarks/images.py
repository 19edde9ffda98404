"""Images per second of CLIP ViT-B/32- and SigLIP-base-shaped random models: embedserv against transformers,
sentence-transformers' CLIP wrapper and Infinity (when its venv exists), all from the same encoded JPEGs.

    python benchmarks/images.py [--models clip-b32,siglip-base] [--images 64] [--batch 16] [--rounds 3]
        [--size 640x480] [--peers ours,transformers,st,infinity]

Every runner starts from the same JPEG bytes (camera-like 640x480 by default) and does the whole job: decode,
resize, normalize, the vision tower and the projection, float32 on the CPU with all its cores. Ours is the
in-process engine (images prepared in its tokenizer pool, calls of --batch images all in flight);
transformers is its image processor plus `get_image_features` per batch; sentence-transformers is
`SentenceTransformer(modules=[CLIPModel(dir)]).encode(images)` (CLIP only: it has no SigLIP image module);
Infinity is `AsyncEmbeddingEngine.image_embed` in its own venv (.peers/infinity, benchmarks/setup_peers.sh) on
its torch engine. Rounds are interleaved across runners and the best round counts (the machine drifts); every
runner's vectors are checked against transformers' (cosine). Prints a markdown table with the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.peer_runners.common import cpu_info
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams, ImageInput
from tests.helpers import vision_models

ROOT = Path(__file__).resolve().parents[1]
INFINITY_PYTHON = ROOT / ".peers" / "infinity" / "bin" / "python"
SHAPES = {
    "clip-b32": ("clip", vision_models.clip_vit_b32_config),
    "siglip-base": ("siglip", vision_models.siglip_base_config),
}
PEERS = ("ours", "transformers", "st", "infinity")


def model_dir(name: str, cache: Path) -> Path:
    out = cache / name
    if not (out / "config.json").exists():
        kind, config = SHAPES[name]
        from tests.helpers.models import _bundled_tokenizer

        vision_models.save_dual_encoder(out, kind, config=config(len(_bundled_tokenizer(64))))
    return out


def jpeg_images(count: int, width: int, height: int) -> list[bytes]:
    return [vision_models.image_bytes(width, height, "JPEG", seed=i) for i in range(count)]


def normalized(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


class Ours:
    def __init__(self, path: Path, batch: int) -> None:
        self.engine = SyncEngine(ModelConfig(path=str(path), served_name="bench"))
        self.batch = batch

    def run(self, images: list[bytes]) -> np.ndarray:
        calls = [[ImageInput(d) for d in images[i : i + self.batch]] for i in range(0, len(images), self.batch)]
        results = self.engine.embed_concurrently(calls, EmbedParams(normalize=True))
        return np.concatenate([r.embeddings for r in results])

    def close(self) -> None:
        self.engine.close()


class Transformers:
    def __init__(self, path: Path, batch: int) -> None:
        from transformers import AutoImageProcessor, AutoModel

        self.model = AutoModel.from_pretrained(str(path)).eval()
        self.processor = AutoImageProcessor.from_pretrained(str(path))
        self.batch = batch

    @torch.inference_mode()
    def run(self, images: list[bytes]) -> np.ndarray:
        out = []
        for i in range(0, len(images), self.batch):
            pictures = [vision_models.decoded(d) for d in images[i : i + self.batch]]
            pixels = self.processor(images=pictures, return_tensors="pt")["pixel_values"]
            features = self.model.get_image_features(pixel_values=pixels)
            out.append(getattr(features, "pooler_output", features).numpy())
        return normalized(np.concatenate(out))

    def close(self) -> None:
        pass


class SentenceTransformers:
    def __init__(self, path: Path, batch: int) -> None:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import CLIPModel

        self.model = SentenceTransformer(modules=[CLIPModel(str(path))], device="cpu")
        self.batch = batch

    def run(self, images: list[bytes]) -> np.ndarray:
        pictures = [vision_models.decoded(d) for d in images]
        return normalized(self.model.encode(pictures, batch_size=self.batch, convert_to_numpy=True))

    def close(self) -> None:
        pass


class Infinity:
    """Runs benchmarks/peer_runners/infinity_images.py in Infinity's venv, one process per round."""

    def __init__(self, path: Path, batch: int) -> None:
        if not INFINITY_PYTHON.exists():
            raise RuntimeError(f"no Infinity venv at {INFINITY_PYTHON} (benchmarks/setup_peers.sh infinity)")
        self.path, self.batch = path, batch
        self.seconds = 0.0

    def run(self, images: list[bytes]) -> np.ndarray:
        with tempfile.TemporaryDirectory() as work:
            job = Path(work) / "job.json"
            files = []
            for i, data in enumerate(images):
                files.append(str(Path(work) / f"{i}.jpg"))
                Path(files[-1]).write_bytes(data)
            job.write_text(
                json.dumps(
                    {
                        "model": str(self.path),
                        "images": files,
                        "batch": self.batch,
                        "vectors": str(Path(work) / "v.npy"),
                        "threads": torch.get_num_threads(),
                    }
                )
            )
            done = subprocess.run(
                [str(INFINITY_PYTHON), "-m", "benchmarks.peer_runners.infinity_images", str(job)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=1200,
            )
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            self.seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
            return normalized(np.load(Path(work) / "v.npy"))

    def close(self) -> None:
        pass


RUNNERS = {"ours": Ours, "transformers": Transformers, "st": SentenceTransformers, "infinity": Infinity}


def bench(name: str, path: Path, images: list[bytes], peers: list[str], batch: int, rounds: int) -> list[dict]:
    kind = SHAPES[name][0]
    runners, failed = {}, {}
    for peer in peers:
        if peer == "st" and kind != "clip":
            failed[peer] = "no SigLIP image module"
            continue
        try:
            runners[peer] = RUNNERS[peer](path, batch)
            runners[peer].run(images[:batch])  # warm-up
        except Exception as e:
            failed[peer] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:100]}"
            runners.pop(peer, None)
    best = {peer: float("inf") for peer in runners}
    vectors = {}
    for _ in range(rounds):
        for peer, runner in runners.items():
            start = time.perf_counter()
            vectors[peer] = runner.run(images)
            # Infinity's own timing excludes its process start and model load.
            seconds = runner.seconds if isinstance(runner, Infinity) else time.perf_counter() - start
            best[peer] = min(best[peer], seconds)
    for runner in runners.values():
        runner.close()
    reference = vectors.get("transformers")
    rows = []
    for peer in peers:
        if peer in failed:
            rows.append({"model": name, "peer": peer, "note": failed[peer]})
            continue
        cosine = float(np.min(np.sum(vectors[peer] * reference, axis=1))) if reference is not None else float("nan")
        rows.append({"model": name, "peer": peer, "images_per_s": len(images) / best[peer], "min_cosine": cosine})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="640x480")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "embedserv-image-bench"))
    args = parser.parse_args()
    width, height = map(int, args.size.split("x"))
    images = jpeg_images(args.images, width, height)
    peers = args.peers.split(",")
    rows = []
    for name in args.models.split(","):
        rows += bench(name, model_dir(name, Path(args.cache)), images, peers, args.batch, args.rounds)
    name, flags = cpu_info()
    isa = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags)
    print(
        f"CPU: {name} ({isa}); torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.images} JPEG {args.size} images, batches of {args.batch}, best of {args.rounds}\n"
    )
    print("| model | runner | images/s | vs transformers | min cosine vs transformers |")
    print("|---|---|---:|---:|---:|")
    base = {r["model"]: r["images_per_s"] for r in rows if r["peer"] == "transformers" and "images_per_s" in r}
    for r in rows:
        if "images_per_s" not in r:
            print(f"| {r['model']} | {r['peer']} | — | — | {r['note']} |")
            continue
        ratio = r["images_per_s"] / base[r["model"]] if r["model"] in base else float("nan")
        print(f"| {r['model']} | {r['peer']} | {r['images_per_s']:.1f} | {ratio:.2f}x | {r['min_cosine']:.5f} |")


if __name__ == "__main__":
    main()
