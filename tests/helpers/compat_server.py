"""One server for the API-compatibility tests (OpenAI, Cohere/Jina, TEI over HTTP and gRPC): gRPC and HTTP
ports, and a model for each task, built once a session.

Models in --model order (TEI's routes pick the first that serves their task unless the x-embedserv-model
header names one): the bundled MiniLM (embed, and rerank by cosine), a tiny BERT cross-encoder (rerank), a
tiny 3-label XLM-R classifier (classify), a tiny Qwen2 LM with a chat template and a tokenizer that adds
no special tokens (generate), so a chat prompt's tokens equal the rendered template's, and a tiny SPLADE
SparseEncoder over MiniLM's vocabulary (the sparse output; MiniLM gives dense and multi-vector).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.models import build_tiny_generator, bundled_model_dir
from tests.helpers.scorers import build_cross_encoder
from tests.helpers.sparse_models import build_splade_encoder

EMBEDDER, CROSS, CLASSIFIER, GENERATOR, SPARSE = "minilm", "tiny-ce", "tiny-cls", "tiny-lm", "tiny-splade"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Small enough that a 400-call burst is refused in part (429), large enough for every other test's call.
MAX_CONCURRENT = 64
MAX_CLIENT_BATCH = 32


@dataclass(frozen=True)
class CompatServer:
    target: str  # gRPC host:port
    http: str  # http://host:port
    http_port: int
    models: dict[str, Path]
    log_path: Path


def build_chat_generator(root: Path) -> Path:
    """The tiny Qwen2 LM with a chat template, its tokenizer adding no special tokens."""
    model_dir = build_tiny_generator(root, "qwen2")
    tokenizer_json = model_dir / "tokenizer.json"
    spec = json.loads(tokenizer_json.read_text())
    spec["post_processor"] = None
    tokenizer_json.write_text(json.dumps(spec))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return model_dir


def build_models(root: Path) -> dict[str, Path]:
    return {
        EMBEDDER: bundled_model_dir(),
        CROSS: build_cross_encoder(root, "bert"),
        CLASSIFIER: build_cross_encoder(root, "xlm-roberta", num_labels=3),
        GENERATOR: build_chat_generator(root),
        SPARSE: build_splade_encoder(root, "bert", "max", "relu"),
    }


def server_args(models: dict[str, Path], http_port: int) -> list[str]:
    args = [
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--http-port",
        str(http_port),
        "--max-client-batch-size",
        str(MAX_CLIENT_BATCH),
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
        "--kv-cache-memory",
        "64MiB",
    ]
    for name, path in models.items():
        args += ["--model", str(path), "--served-model-name", name]
    return args
