"""Infinity's image embeddings in process (its torch engine, float32 on the CPU), for benchmarks/images.py. Runs under
Infinity's venv:

    .peers/infinity/bin/python -m benchmarks.peer_runners.infinity_images JOB.json

The job names the model directory, the image files (read as bytes, as a server receives them), the batch size and
where the vectors go. One untimed pass warms up; the timed pass embeds every image; prints {"seconds": ...}.

Infinity loads the model's whole processor, whose CLIP tokenizer transformers 4.47 insists on (its CLIPProcessor
refuses the random models' WordPiece tokenizer); image embeddings never read it, so a copy of the directory gets a
byte-level CLIP tokenizer with no merges.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


def with_clip_tokenizer(model: str, work: Path) -> str:
    from transformers import CLIPTokenizerFast
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    out = work / "model"
    out.mkdir(exist_ok=True)
    for source in Path(model).iterdir():
        if not source.name.startswith(("tokenizer", "vocab", "special_tokens")) and not (out / source.name).exists():
            (out / source.name).symlink_to(source)
    symbols = list(bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    (out / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    (out / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizerFast.from_pretrained(str(out), from_slow=True).save_pretrained(str(out))
    return str(out)


async def run(job: dict) -> tuple[float, object]:
    import numpy as np
    import torch
    from infinity_emb import AsyncEmbeddingEngine, EngineArgs

    torch.set_num_threads(job["threads"])
    model = job["model"]
    if json.loads((Path(model) / "config.json").read_text())["model_type"] == "clip":
        model = with_clip_tokenizer(model, Path(job["vectors"]).parent)
    args = EngineArgs(
        model_name_or_path=model,
        engine="torch",
        device="cpu",
        dtype="float32",
        batch_size=job["batch"],
        bettertransformer=False,
        model_warmup=False,
    )
    images = [Path(p).read_bytes() for p in job["images"]]
    engine = AsyncEmbeddingEngine.from_args(args)
    async with engine:
        await engine.image_embed(images=images[: job["batch"]])
        start = time.perf_counter()
        # Calls of one batch each, all in flight, as a server's clients would send them.
        calls = [engine.image_embed(images=images[i : i + job["batch"]]) for i in range(0, len(images), job["batch"])]
        results = await asyncio.gather(*calls)
        seconds = time.perf_counter() - start
    vectors = np.stack([np.asarray(v, dtype=np.float32) for embeddings, _ in results for v in embeddings])
    return seconds, vectors


def main() -> None:
    import numpy as np

    job = json.loads(Path(sys.argv[1]).read_text())
    seconds, vectors = asyncio.run(run(job))
    np.save(job["vectors"], vectors)
    print(json.dumps({"seconds": seconds}))


if __name__ == "__main__":
    main()
