"""MultiVectorEncoder (ColBERT-style) directories for tests: a small random-weight BERT with token-level Dense
layers, Normalize and MultiVectorMask, saved by sentence-transformers' own MultiVectorEncoder.save, and the
library loaded on it as the reference.

The tokenizer is the bundled all-MiniLM-L6-v2 WordPiece tokenizer (it has a [MASK] token for query
expansion); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from tests.helpers.models import _bundled_tokenizer, _check_weights_saved, _config

HIDDEN = 64
# Two token-level Dense layers: 64 -> 48 (tanh) -> 32 (no bias).
DIMENSION = 32


def build_multi_vector_encoder(
    tmp_dir: Path | str,
    seed: int = 0,
    max_seq_length: int = 128,
    prompts: dict[str, str] | None = None,
    skiplist_words: list[str] | None = None,
    skiplist_tasks: list[str] | None = None,
    query_length: int | None = None,
    document_length: int | None = None,
    query_expansion: dict | None = None,
    similarity_fn_name: str | None = None,
    keep_only_token_ids: list[int] | None = None,
    mask_before_normalize: bool = False,
) -> Path:
    """Build and save a random-weight MultiVectorEncoder under tmp_dir; return its directory.

    Modules: Transformer, Dense, Dense, Normalize, MultiVectorMask (or, with `mask_before_normalize`, the
    order the library's own default models use: Transformer, Dense, Dense, MultiVectorMask, Normalize)."""
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask
    from transformers import AutoModel

    options = repr(
        (
            seed,
            max_seq_length,
            prompts,
            skiplist_words,
            skiplist_tasks,
            query_length,
            document_length,
            query_expansion,
            similarity_fn_name,
            keep_only_token_ids,
            mask_before_normalize,
        )
    )
    name = f"tiny-mve-{hashlib.sha1(options.encode()).hexdigest()[:10]}"
    out, hf_dir = Path(tmp_dir) / name, Path(tmp_dir) / f"{name}-hf"
    if out.exists():
        return out

    tokenizer = _bundled_tokenizer(max_seq_length)
    torch.manual_seed(seed)
    model = AutoModel.from_config(_config("bert", vocab_size=len(tokenizer)), attn_implementation="eager").eval()
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))

    transformer = Transformer(
        str(hf_dir), query_length=query_length, document_length=document_length, query_expansion=query_expansion
    )
    dense = [
        Dense(HIDDEN, 48, activation_function=torch.nn.Tanh(), module_input_name="token_embeddings"),
        Dense(48, DIMENSION, bias=False, activation_function=torch.nn.Identity(), module_input_name="token_embeddings"),
    ]
    # Random biases, so a bias that is not loaded shows.
    torch.nn.init.normal_(dense[0].linear.bias, std=0.2)
    normalize = Normalize(module_input_name="token_embeddings")
    mask = MultiVectorMask(
        skiplist_words=skiplist_words, skiplist_tasks=skiplist_tasks, keep_only_token_ids=keep_only_token_ids
    )
    tail = [mask, normalize] if mask_before_normalize else [normalize, mask]
    mve = MultiVectorEncoder(
        modules=[transformer, *dense, *tail], device="cpu", prompts=prompts, similarity_fn_name=similarity_fn_name
    )
    mve.save(str(out), create_model_card=False)
    _check_weights_saved(out)
    shutil.rmtree(hf_dir)
    return out


def load_multi_vector_reference(model_dir: Path | str):
    """sentence-transformers' MultiVectorEncoder on the same directory, float32 on CPU: the oracle."""
    from sentence_transformers import MultiVectorEncoder

    return MultiVectorEncoder(str(model_dir), device="cpu", model_kwargs={"attn_implementation": "eager"})


def edited_copy(model_dir: Path, out: Path, edits: dict[str, dict | list | None]) -> Path:
    """A copy of model_dir with some JSON files replaced (file name -> new content; None removes the file)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model_dir, out)
    for name, content in edits.items():
        if content is None:
            (out / name).unlink()
        else:
            (out / name).write_text(json.dumps(content, indent=2))
    return out


def read_json(path: Path) -> dict | list:
    return json.loads(path.read_text())
