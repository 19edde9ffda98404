"""How close `--quantization int8` stays to float32, per model: cosine of each text's vector.

    PYTHONPATH=. python benchmarks/int8_cosine.py DIR [DIR ...] [--texts 64]

Each model directory is embedded in this process twice, float32 and int8, over the same real texts
(benchmarks/corpus.py); prints the lowest and mean cosine per model as a markdown table. The peer shapes
live under .peers/models once benchmarks/peers.py has built them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks.corpus import stdlib_texts
from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams


def embed(model: str, texts: list[str], quantization: str | None) -> np.ndarray:
    engine = SyncEngine(ModelConfig(path=model, served_name="m", quantization=quantization))
    try:
        return engine.embed(texts, EmbedParams(truncate=True)).embeddings
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--texts", type=int, default=64)
    args = parser.parse_args()
    texts = stdlib_texts(args.texts, seed=0)
    print(f"{len(texts)} texts, float32 against int8, vectors normalized\n")
    print("| model | min cosine | mean cosine |\n|---|---:|---:|")
    for model in args.models:
        cosines = (embed(model, texts, None) * embed(model, texts, "int8")).sum(axis=1)
        name = "/".join(Path(model).parts[-2:])
        print(f"| {name} | {cosines.min():.4f} | {cosines.mean():.4f} |", flush=True)


if __name__ == "__main__":
    main()
