"""PEFT LoRA adapters for the --lora tests, and the references they are compared with.

An adapter is made with peft.get_peft_model over the test model's transformers class and saved with
save_pretrained (adapter_config.json + adapter_model.safetensors). PEFT starts lora_B at zero (the adapter
is then the identity), so B is drawn at random, seeded, large enough that each adapter moves the outputs
well past the parity tolerance. The reference is PEFT's own merge (merge_and_unload) saved as a plain model.
"""

from __future__ import annotations

import json
from pathlib import Path

# Every BERT linear PEFT can target: query/key/value (packed into one qkv here), the attention output, and
# the MLP ("output.dense" also matches attention.output.dense).
BERT_TARGETS = ("query", "key", "value", "output.dense", "intermediate.dense")
MPNET_TARGETS = ("q", "k", "v", "o", "intermediate.dense", "output.dense")
# ModernBERT's: attn.Wqkv, attn.Wo and mlp.Wo, mlp.Wi (GeGLU's input and gate in one linear).
MODERNBERT_TARGETS = ("Wqkv", "Wo", "Wi")
# B's scale: random LoRA weights of this size move a tiny model's outputs clearly.
_B_STD = 0.2


def _model_class(kind: str):
    from transformers import AutoModel, AutoModelForSequenceClassification

    return {"embed": AutoModel, "classify": AutoModelForSequenceClassification}[kind]


def build_adapter(model_dir: Path, out: Path, seed: int, kind: str = "embed", **lora) -> Path:
    """A PEFT LoRA adapter of the transformers model in `model_dir` (`lora`: LoraConfig fields), saved in `out`."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = _model_class(kind).from_pretrained(str(model_dir), attn_implementation="eager")
    peft_model = get_peft_model(model, LoraConfig(**lora))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, _B_STD)
            elif "modules_to_save" in name:
                # The adapter's own copy of the classifier head (task_type SEQ_CLS) starts as the base's.
                parameter.add_(torch.randn_like(parameter) * parameter.std().clamp_min(0.1))
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def merged_model(model_dir: Path, adapter_dir: Path, out: Path, kind: str = "embed") -> Path:
    """The base with the adapter merged in by PEFT, saved (with the tokenizer) as a transformers directory."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    base = _model_class(kind).from_pretrained(str(model_dir), attn_implementation="eager")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(out))
    return out


def merged_sentence_transformer(model_dir: Path, adapter_dir: Path, out: Path, pooling: str, max_seq_length: int):
    """sentence-transformers over the merged model, with the base directory's pooling."""
    from tests.helpers.models import _save_sentence_transformer

    hf_dir = merged_model(model_dir, adapter_dir, out.with_name(out.name + "-hf"))
    _save_sentence_transformer(hf_dir, out, pooling, max_seq_length, prompts=None)
    return out


def edit_adapter_config(adapter_dir: Path, **changes) -> Path:
    """The adapter's config with `changes` (what a refusal test feeds the server)."""
    config_file = adapter_dir / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))
    return adapter_dir
