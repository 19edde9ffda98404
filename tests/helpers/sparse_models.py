"""Model directories for the sparse and bge-m3 tests: small random-weight models saved as published.

- `save_mlm`: a *ForMaskedLM checkpoint (BERT or XLM-R) as transformers saves it, with the bundled MiniLM
  tokenizer: what `--pooling splade` serves.
- `build_splade_encoder`: that checkpoint wrapped by sentence-transformers 6 as a SparseEncoder
  (Transformer with transformer_task="fill-mask", then SpladePooling) and saved by it.
- `build_bge_m3`: an XLMRobertaModel saved as a SentenceTransformer (Transformer, CLS Pooling, Normalize)
  with bge-m3's head files beside it, as FlagEmbedding saves them (torch.save of nn.Linear state dicts)
  or converted to safetensors.

The MLM heads' biases are shifted down so only a few vocabulary ids of a sequence score above 0, as in a
trained SPLADE model (a random head puts two thirds of the vocabulary above 0).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.models import _bundled_tokenizer, _config, _perturb_constant_parameters

MAX_SEQ_LENGTH = 128
HIDDEN_SIZE = 64
# Added to the MLM head's bias: with the tiny models' logits (std ~1.3) about 1-2% of the ids of a
# token score above 0.
_MLM_BIAS_SHIFT = -3.0


def save_mlm(tmp_dir: Path | str, arch: str, seed: int = 0, tie_word_embeddings: bool = True) -> Path:
    """A random-weight BertForMaskedLM / XLMRobertaForMaskedLM directory (weights, config, tokenizer)."""
    import torch
    from transformers import AutoModelForMaskedLM

    out = Path(tmp_dir) / f"mlm-{arch}-s{seed}-{'tied' if tie_word_embeddings else 'untied'}"
    if out.exists():
        return out
    tokenizer = _bundled_tokenizer(MAX_SEQ_LENGTH)
    config = _config(arch, vocab_size=len(tokenizer))
    config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = AutoModelForMaskedLM.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    with torch.no_grad():
        # The bias the logits use: the head's own when tied, the decoder's when not (transformers 5 ties
        # them only with the embeddings), so an untied checkpoint holds two different biases.
        model.get_output_embeddings().bias.add_(_MLM_BIAS_SHIFT)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def build_splade_encoder(
    tmp_dir: Path | str, arch: str, pooling: str, activation: str, seed: int = 0, tie_word_embeddings: bool = True
) -> Path:
    """A SparseEncoder directory exactly as sentence-transformers 6 saves one; return it."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    mlm = save_mlm(tmp_dir, arch, seed, tie_word_embeddings)
    out = Path(tmp_dir) / f"splade-{mlm.name}-{pooling}-{activation}"
    transformer = Transformer(str(mlm), transformer_task="fill-mask", max_seq_length=MAX_SEQ_LENGTH)
    pool = SpladePooling(pooling_strategy=pooling, activation_function=activation)
    SparseEncoder(modules=[transformer, pool], device="cpu").save(str(out), create_model_card=False)
    return out


def load_sparse_reference(model_dir: Path | str):
    """sentence-transformers' SparseEncoder on the directory, float32 on CPU: the oracle."""
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(model_dir), device="cpu", model_kwargs={"attn_implementation": "eager"})


def build_bge_m3(tmp_dir: Path | str, seed: int = 0, head_format: str = "pt") -> Path:
    """A tiny bge-m3: XLM-R weights, SentenceTransformer files (Transformer, CLS Pooling, Normalize) and
    sparse_linear / colbert_linear head files (`head_format` "pt" or "safetensors"); return its directory."""
    import torch
    from safetensors.torch import save_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from torch import nn
    from transformers import AutoModel

    if head_format not in ("pt", "safetensors"):
        raise ValueError(f"head_format must be pt or safetensors, not {head_format!r}")
    out = Path(tmp_dir) / f"bge-m3-s{seed}-{head_format}"
    hf_dir = Path(tmp_dir) / f"bge-m3-s{seed}-hf"
    if not hf_dir.exists():
        tokenizer = _bundled_tokenizer(MAX_SEQ_LENGTH)
        torch.manual_seed(seed)
        model = AutoModel.from_config(_config("xlm-roberta", len(tokenizer)), attn_implementation="eager").eval()
        _perturb_constant_parameters(model, seed)
        model.save_pretrained(str(hf_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(hf_dir))
    transformer = Transformer(str(hf_dir), max_seq_length=MAX_SEQ_LENGTH)
    st = SentenceTransformer(modules=[transformer, Pooling(HIDDEN_SIZE, pooling_mode="cls"), Normalize()], device="cpu")
    st.save(str(out), create_model_card=False)
    # FlagEmbedding's heads: one weight per token, and a colbert projection as wide as the model.
    generator = torch.Generator().manual_seed(seed + 7)
    for name, out_features in (("sparse_linear", 1), ("colbert_linear", HIDDEN_SIZE)):
        linear = nn.Linear(HIDDEN_SIZE, out_features)
        with torch.no_grad():
            linear.weight.copy_(0.2 * torch.randn(linear.weight.shape, generator=generator))
            linear.bias.copy_(0.1 * torch.randn(linear.bias.shape, generator=generator))
            if out_features == 1:
                # The random encoder's tokens share a direction this head scores about -0.8; shifted, about
                # a third of them get a weight above 0, so max-per-id and the special-token rule both matter.
                linear.bias.add_(0.8)
        if head_format == "pt":
            torch.save(linear.state_dict(), out / f"{name}.pt")
        else:
            save_file(linear.state_dict(), str(out / f"{name}.safetensors"))
    return out


def bge_m3_heads(model_dir: Path) -> dict[str, dict]:
    """The head files' state dicts (either format), for the reference computation."""
    import torch
    from safetensors.torch import load_file

    heads = {}
    for name in ("sparse_linear", "colbert_linear"):
        path = model_dir / f"{name}.safetensors"
        heads[name] = load_file(str(path)) if path.exists() else torch.load(model_dir / f"{name}.pt", weights_only=True)
    return heads


def write_pickle_with_code(path: Path) -> None:
    """A .pt file whose unpickling would call a function (os.getcwd: harmless), as a malicious head would."""
    import os
    import pickle

    class _Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    path.write_bytes(pickle.dumps({"weight": _Payload()}))


def copy_model_dir(source: Path, target: Path, config_changes: dict | None = None) -> Path:
    """A copy of a model directory, config.json updated with `config_changes`."""
    shutil.copytree(source, target)
    if config_changes:
        config_path = target / "config.json"
        config = json.loads(config_path.read_text())
        config.update(config_changes)
        config_path.write_text(json.dumps(config, indent=2))
    return target
