"""Tiny random-weight jina-embeddings-v3 models, in the forms the parity tests compare.

One transformers JinaEmbeddingsV3Model (random weights) and random LoRA adapters, one per task, give:
- `native`: the model as transformers saves it (model_type jina_embeddings_v3, no adapters: transformers'
  class has none), as a sentence-transformers directory;
- `published`: the same weights and the adapters as jinaai/jina-embeddings-v3 publishes them: config.json
  with model_type xlm-roberta, auto_map, position_embedding_type rotary, lora_* and task_instructions keys,
  and tensors named `roberta.encoder.layers.N.mixer.Wqkv.parametrizations.weight.original` /
  `...parametrizations.weight.0.lora_A`; its config_sentence_transformers.json holds the task prompts;
- `merged[task]`: the model with that task's adapter merged into its weights (`W + alpha / rank * B A`, as
  the published LoRAParametrization computes its weights), the reference for that task.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.models import TINY_ENCODER, _bundled_tokenizer, _save_sentence_transformer

TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")
# jinaai/jina-embeddings-v3's task_instructions (and its sentence-transformers prompts).
INSTRUCTIONS = {
    "retrieval.query": "Represent the query for retrieving evidence documents: ",
    "retrieval.passage": "Represent the document for retrieval: ",
    "separation": "",
    "classification": "",
    "text-matching": "",
}
RANK, ALPHA = 4, 1
ROPE_THETA = 20_000.0


def _config(vocab_size: int):
    from transformers import JinaEmbeddingsV3Config

    return JinaEmbeddingsV3Config(
        **TINY_ENCODER,
        vocab_size=vocab_size,
        layer_norm_eps=1e-5,
        max_position_embeddings=8194,
        type_vocab_size=1,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )


def _adapters(model, seed: int) -> dict:
    """Random (lora_A, lora_B) per adapted weight name, each [tasks, ...] in the published layout: linears
    A [tasks, rank, in], B [tasks, out, rank]; embeddings A [tasks, rows, rank], B [tasks, rank, dim]."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1000)
    out = {}
    n = len(TASKS)
    for name, tensor in model.state_dict().items():
        if not name.endswith(".weight") or "norm" in name.lower():
            continue
        if "embeddings" in name:
            rows, dim = tensor.shape
            a, b = torch.randn(n, rows, RANK, generator=generator), torch.randn(n, RANK, dim, generator=generator)
        else:
            fan_out, fan_in = tensor.shape
            a, b = torch.randn(n, RANK, fan_in, generator=generator), torch.randn(n, fan_out, RANK, generator=generator)
        # Updates of about the weights' own size: every task moves the outputs well away from the base's.
        out[name] = (a * 0.3, b * 0.3)
    return out


def _merged_state(base: dict, adapters: dict, task: int) -> dict:
    state = {k: v.clone() for k, v in base.items()}
    scaling = ALPHA / RANK
    for name, (a, b) in adapters.items():
        # Linears: B @ A ([out, in]); embeddings: A @ B ([rows, dim]), as LoRAParametrization swaps them.
        delta = a[task] @ b[task] if "embeddings" in name else b[task] @ a[task]
        state[name] += scaling * delta
    return state


def _published_tensors(model, adapters: dict) -> dict:
    """The state dict and adapters under jinaai/jina-embeddings-v3's names (under `roberta.`)."""
    import torch

    state = model.state_dict()
    out = {}

    def weight(published: str, ours: str) -> None:
        out[f"roberta.{published}.parametrizations.weight.original"] = state[f"{ours}.weight"]
        a, b = adapters[f"{ours}.weight"]
        out[f"roberta.{published}.parametrizations.weight.0.lora_A"] = a
        out[f"roberta.{published}.parametrizations.weight.0.lora_B"] = b

    weight("embeddings.word_embeddings", "embeddings.word_embeddings")
    weight("embeddings.token_type_embeddings", "embeddings.token_type_embeddings")
    out["roberta.emb_ln.weight"] = state["embeddings.LayerNorm.weight"]
    out["roberta.emb_ln.bias"] = state["embeddings.LayerNorm.bias"]
    for i in range(model.config.num_hidden_layers):
        ours, published = f"layers.{i}", f"encoder.layers.{i}"
        attn = f"{ours}.self_attn"
        out[f"roberta.{published}.mixer.Wqkv.parametrizations.weight.original"] = torch.cat(
            [state[f"{attn}.{p}_proj.weight"] for p in "qkv"]
        )
        out[f"roberta.{published}.mixer.Wqkv.bias"] = torch.cat([state[f"{attn}.{p}_proj.bias"] for p in "qkv"])
        qkv = [adapters[f"{attn}.{p}_proj.weight"] for p in "qkv"]
        # One adapter on the packed Wqkv: one A, B rows stacked. The per-projection A's differ, so the test
        # model takes q's A for all three and rebuilds k's and v's merged weights from it (see build_jina).
        out[f"roberta.{published}.mixer.Wqkv.parametrizations.weight.0.lora_A"] = qkv[0][0]
        out[f"roberta.{published}.mixer.Wqkv.parametrizations.weight.0.lora_B"] = torch.cat([b for _, b in qkv], dim=1)
        weight(f"{published}.mixer.out_proj", f"{attn}.o_proj")
        out[f"roberta.{published}.mixer.out_proj.bias"] = state[f"{attn}.o_proj.bias"]
        for part in ("fc1", "fc2"):
            weight(f"{published}.mlp.{part}", f"{ours}.mlp.{part}")
            out[f"roberta.{published}.mlp.{part}.bias"] = state[f"{ours}.mlp.{part}.bias"]
        for norm, published_norm in (("post_attention_layernorm", "norm1"), ("post_mlp_layernorm", "norm2")):
            for kind in ("weight", "bias"):
                out[f"roberta.{published}.{published_norm}.{kind}"] = state[f"{ours}.{norm}.{kind}"]
    weight("pooler.dense", "pooler.dense")
    out["roberta.pooler.dense.bias"] = state["pooler.dense.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def published_config(config) -> dict:
    """config.json as jinaai/jina-embeddings-v3 publishes it, for these sizes."""
    return {
        "architectures": ["XLMRobertaLoRA"],
        "auto_map": {
            "AutoConfig": "jinaai/xlm-roberta-flash-implementation--configuration_xlm_roberta.XLMRobertaFlashConfig",
            "AutoModel": "jinaai/xlm-roberta-flash-implementation--modeling_lora.XLMRobertaLoRA",
        },
        "attention_probs_dropout_prob": 0.0,
        "bos_token_id": 0,
        "classifier_dropout": None,
        "emb_pooler": None,
        "eos_token_id": 2,
        "hidden_act": config.hidden_act,
        "hidden_dropout_prob": 0.0,
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "layer_norm_eps": config.layer_norm_eps,
        "load_trained_adapters": True,
        "lora_adaptations": list(TASKS),
        "lora_alpha": ALPHA,
        "lora_dropout_p": 0.0,
        "lora_main_params_trainable": False,
        "lora_rank": RANK,
        "matryoshka_dimensions": [16, 32, 64],
        "max_position_embeddings": config.max_position_embeddings,
        "model_type": "xlm-roberta",
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": config.num_hidden_layers,
        "output_past": True,
        "pad_token_id": config.pad_token_id,
        "position_embedding_type": "rotary",
        "rotary_emb_base": ROPE_THETA,
        "task_instructions": dict(INSTRUCTIONS),
        "torch_dtype": "float32",
        "type_vocab_size": config.type_vocab_size,
        "use_cache": True,
        "use_flash_attn": True,
        "vocab_size": config.vocab_size,
    }


def build_jina(tmp_dir: Path | str, pooling: str, seed: int = 0, max_seq_length: int = 128) -> dict:
    """{"native": dir, "published": dir, "merged": {task: dir}} for one random model (see the module doc)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel

    root = Path(tmp_dir) / f"tiny-jina-v3-{pooling}-s{seed}-L{max_seq_length}"
    tokenizer = _bundled_tokenizer(max_seq_length)
    config = _config(len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    adapters = _adapters(model, seed)
    # The packed Wqkv has one A for q, k and v (see _published_tensors): make the reference's the same.
    for i in range(config.num_hidden_layers):
        q_a = adapters[f"layers.{i}.self_attn.q_proj.weight"][0]
        for p in "kv":
            name = f"layers.{i}.self_attn.{p}_proj.weight"
            adapters[name] = (q_a, adapters[name][1])

    def save(state: dict, name: str) -> Path:
        hf_dir = root / f"{name}-hf"
        model.load_state_dict(state)
        model.save_pretrained(str(hf_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(hf_dir))
        _save_sentence_transformer(hf_dir, root / name, pooling, max_seq_length, prompts=None)
        return root / name

    base = {k: v.clone() for k, v in model.state_dict().items()}
    merged = {task: save(_merged_state(base, adapters, index), task) for index, task in enumerate(TASKS)}
    native = save(base, "native")

    published = root / "published"
    shutil.copytree(native, published)
    (published / "model.safetensors").unlink()
    save_file(_published_tensors(model, adapters), str(published / "model.safetensors"))
    (published / "config.json").write_text(json.dumps(published_config(config), indent=2))
    st_config = json.loads((published / "config_sentence_transformers.json").read_text())
    st_config["prompts"] = dict(INSTRUCTIONS)
    (published / "config_sentence_transformers.json").write_text(json.dumps(st_config, indent=2))
    return {"native": native, "published": published, "merged": merged}


def build_jina_cross_encoder(tmp_dir: Path | str, seed: int = 0, max_seq_length: int = 128) -> Path:
    """A random-weight JinaEmbeddingsV3ForSequenceClassification (one label, XLM-R's classifier head) saved
    as a sentence-transformers CrossEncoder directory."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification

    from tests.helpers.scorers import CROSS_ENCODER_HEAD_SCALE, _scale_classifier_output

    out = Path(tmp_dir) / f"tiny-jina-v3-ce-s{seed}"
    hf_dir = Path(tmp_dir) / f"tiny-jina-v3-ce-s{seed}-hf"
    tokenizer = _bundled_tokenizer(max_seq_length)
    config = _config(len(tokenizer))
    # The copied BERT tokenizer gives a pair's second text type id 1.
    config.type_vocab_size = 2
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    _scale_classifier_output(model, CROSS_ENCODER_HEAD_SCALE)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))
    CrossEncoder(str(hf_dir), device="cpu").save(str(out), create_model_card=False)
    return out
