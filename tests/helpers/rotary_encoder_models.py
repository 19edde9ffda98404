"""Small random-weight rotary encoders (NomicBERT, GTE) for the parity tests, and the same weights in the
forms their published checkpoints take.

transformers 5 saves these types under the published custom code's tensor names (emb_ln, attn.Wqkv, ...
for nomic_bert; encoder.layer.N.attention.qkv_proj, ... for gte), so `save_pretrained` gives those;
`write_native_names` rewrites a directory's weights under transformers' own module names. The published
config.json forms (GPT-2-style keys for nomic_bert, model_type "new" for GTE) come from `publish_*`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from tests.helpers.models import _bundled_tokenizer, _perturb_constant_parameters, _save_sentence_transformer
from tests.helpers.scorers import _label_maps

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    # Large enough that random outputs of different texts are well separated.
    initializer_range=0.15,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    layer_norm_eps=1e-12,
)
# The texts fixture runs past 128 tokens; 512 positions keep every table lookup in range.
MAX_POSITIONS = 512


def _config(arch: str, vocab_size: int, **overrides):
    from transformers import GteConfig, NomicBertConfig

    if arch == "nomic_bert":
        options = dict(COMMON, vocab_size=vocab_size, max_position_embeddings=MAX_POSITIONS, type_vocab_size=2)
        options["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000.0}
        return NomicBertConfig(**(options | overrides))
    if arch == "gte":
        options = dict(COMMON, vocab_size=vocab_size, max_position_embeddings=MAX_POSITIONS, type_vocab_size=1)
        options["rope_parameters"] = {"rope_type": "default", "rope_theta": 500_000.0}
        options["pad_token_id"] = 0
        return GteConfig(**(options | overrides))
    raise ValueError(f"arch must be nomic_bert or gte, not {arch!r}")


def build_rotary_encoder(
    tmp_dir: Path | str,
    arch: str,
    pooling: str,
    seed: int = 0,
    max_seq_length: int = 128,
    prompts: dict[str, str] | None = None,
    **overrides,
) -> Path:
    """A sentence-transformers directory around a random `arch` model (its norms and biases perturbed)."""
    import torch
    from transformers import AutoModel

    digest = hashlib.sha1(repr((sorted((prompts or {}).items()), sorted(overrides.items()))).encode()).hexdigest()[:8]
    name = f"tiny-{arch}-{pooling}-s{seed}-L{max_seq_length}-{digest}"
    out, hf_dir = Path(tmp_dir) / name, Path(tmp_dir) / f"{name}-hf"
    tokenizer = _bundled_tokenizer(max_seq_length)
    config = _config(arch, len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))
    _save_sentence_transformer(hf_dir, out, pooling, max_seq_length, prompts)
    return out


def build_rotary_classifier(tmp_dir: Path | str, arch: str, num_labels: int = 3, seed: int = 0) -> Path:
    """A random *ForSequenceClassification of `arch` saved as a sentence-transformers CrossEncoder."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification

    name = f"tiny-ce-{arch}-s{seed}-n{num_labels}"
    out, hf_dir = Path(tmp_dir) / name, Path(tmp_dir) / f"{name}-hf"
    tokenizer = _bundled_tokenizer(128)
    # The copied BERT tokenizer gives a pair's second text token type 1.
    config = _config(arch, len(tokenizer), type_vocab_size=2, num_labels=num_labels, **_label_maps(num_labels))
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    with torch.no_grad():
        model.classifier.weight.mul_(3.0)  # spread the logits of similar pooled states
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))
    CrossEncoder(str(hf_dir), device="cpu").save(str(out), create_model_card=False)
    return out


def _copy(model_dir: Path, out: Path) -> Path:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model_dir, out)
    return out


def write_native_names(model_dir: Path, out: Path) -> Path:
    """A copy of model_dir whose weights carry transformers' module names (layers.N.self_attn.q_proj, ...)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoModelForSequenceClassification

    out = _copy(model_dir, out)
    config = json.loads((model_dir / "config.json").read_text())
    is_classifier = config["architectures"][0].endswith("ForSequenceClassification")
    loader = AutoModelForSequenceClassification if is_classifier else AutoModel
    model = loader.from_pretrained(str(model_dir), dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    return out


def publish_nomic(model_dir: Path, out: Path) -> Path:
    """A copy of model_dir with config.json as nomic-ai/nomic-embed-text-v1.5 publishes it (GPT-2-style keys,
    auto_map to nomic-ai/nomic-bert-2048)."""
    out = _copy(model_dir, out)
    native = json.loads((model_dir / "config.json").read_text())
    published = {
        "activation_function": "swiglu",
        "architectures": ["NomicBertModel"],
        "attn_pdrop": 0.0,
        "auto_map": {
            "AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
            "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel",
            "AutoModelForMaskedLM": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertForPreTraining",
        },
        "bos_token_id": None,
        "causal": False,
        "dense_seq_output": True,
        "embd_pdrop": 0.0,
        "eos_token_id": None,
        "fused_bias_fc": True,
        "fused_dropout_add_ln": True,
        "initializer_range": 0.02,
        "layer_norm_epsilon": native["layer_norm_eps"],
        "max_trained_positions": 2048,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "model_type": "nomic_bert",
        "n_embd": native["hidden_size"],
        "n_head": native["num_attention_heads"],
        "n_inner": native["intermediate_size"],
        "n_layer": native["num_hidden_layers"],
        "n_positions": native["max_position_embeddings"],
        "pad_vocab_size_multiple": 1,
        "parallel_block": False,
        "parallel_block_tied_norm": False,
        "prenorm": False,
        "qkv_proj_bias": False,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.0,
        "rotary_emb_base": native["rope_parameters"]["rope_theta"],
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_activation": None,
        "summary_first_dropout": 0.0,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "torch_dtype": "float32",
        "transformers_version": "4.34.0",
        "type_vocab_size": native["type_vocab_size"],
        "use_cache": True,
        "use_flash_attn": True,
        "use_rms_norm": False,
        "use_xentropy": True,
        "vocab_size": native["vocab_size"],
    }
    (out / "config.json").write_text(json.dumps(published, indent=2))
    return out


def publish_gte(model_dir: Path, out: Path, model_type: str = "new", rope_scaling: dict | None = None) -> Path:
    """A copy of model_dir with config.json as Alibaba-NLP's gte v1.5 / multilingual models publish it
    (model_type "new", auto_map to Alibaba-NLP/new-impl), or as Snowflake's arctic-embed v2.0 does
    (model_type "gte" with the same keys)."""
    out = _copy(model_dir, out)
    native = json.loads((model_dir / "config.json").read_text())
    published = {key: value for key, value in native.items() if key not in ("rope_parameters", "dtype", "model_type")}
    published.update(
        model_type=model_type,
        architectures=[native["architectures"][0].replace("Gte", "New" if model_type == "new" else "Gte")],
        auto_map={
            "AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig",
            "AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel",
            "AutoModelForSequenceClassification": "Alibaba-NLP/new-impl--modeling.NewForSequenceClassification",
        },
        layer_norm_type="layer_norm",
        logn_attention_clip1=False,
        logn_attention_scale=False,
        pack_qkv=True,
        position_embedding_type="rope",
        rope_scaling=rope_scaling,
        rope_theta=native["rope_parameters"]["rope_theta"],
        torch_dtype="float32",
        unpad_inputs=True,
        use_memory_efficient_attention=True,
    )
    (out / "config.json").write_text(json.dumps(published, indent=2))
    if model_type == "new":
        _rename_prefix(out / "model.safetensors", "gte.", "new.")
    return out


def _rename_prefix(path: Path, old: str, new: str) -> None:
    """new-impl's task models nest the backbone under `new.` where transformers' gte ones use `gte.`."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    save_file({(new + name[len(old) :] if name.startswith(old) else name): t for name, t in state.items()}, str(path))
