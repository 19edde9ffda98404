"""The model directory Infinity's ONNX engine (peer infinity-onnx) serves, exported by Infinity's own optimum.
Runs under the Infinity venv before its server starts:

    .peers/infinity/bin/python -m benchmarks.peer_runners.infinity_onnx_export JOB.json

Infinity's optimum engine loads an existing *.onnx file (it does not export one) and tokenizes with
`max_length=config.max_position_embeddings`, not the sentence-transformers max_seq_length
(infinity_emb/transformer/embedder/optimum.py). So the exported directory's config.json gets
max_position_embeddings = max_seq_length after the export: the ONNX graph keeps its position table, and the
tokenizer then truncates where every other peer does.
"""

from __future__ import annotations

import json
from pathlib import Path

from .common import read_job


def main() -> None:
    from optimum.onnxruntime import ORTModelForFeatureExtraction
    from transformers import AutoTokenizer

    job = read_job()
    out = Path(job["export_dir"])
    ORTModelForFeatureExtraction.from_pretrained(job["model"], export=True).save_pretrained(out)
    AutoTokenizer.from_pretrained(job["model"]).save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = job["max_seq_length"]
    config_path.write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main()
