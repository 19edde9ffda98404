"""Random-weight DeBERTa-v2/v3 models for the parity tests: sentence-transformers embedders, cross-encoders
(rerankers and classifiers) and NLI classifiers, all with the bundled WordPiece tokenizer.

Two variants cover the configuration switches transformers' DebertaV2Model reads:
- "v3" (deberta-v3, mxbai-rerank, the MoritzLaurer NLI models): log position buckets, q/k projections
  shared with the relative embeddings (share_att_key), LayerNorm'd relative embeddings, no absolute
  positions, no token types. Buckets and max_relative_positions are scaled down (16 and 64 instead of
  256 and 512) so that the tiny models' 128-token inputs pass the bucket range.
- "v2" (the older v2 layout): plain clamped distances (max_relative_positions 32), separate pos_key /
  pos_query projections, absolute positions added to the input, two token types, no embedding norm.
- "absolute": "v2" with relative_attention off: BERT-like attention, which transformers still scales by
  the pos_att_type terms it lists.

The saved tokenizer is the bundled BertTokenizer(Fast): transformers loads what tokenizer_config.json
names, so our engine and the references (sentence-transformers, transformers) tokenize alike, without
DeBERTa's SentencePiece files (tests/models/test_deberta_parity.py checks that they do).
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.models import (
    TINY_ENCODER,
    _bundled_tokenizer,
    _perturb_constant_parameters,
    _save_sentence_transformer,
)
from tests.helpers.nli_models import NLI_HEAD_SCALE, _center_head
from tests.helpers.scorers import CROSS_ENCODER_HEAD_SCALE, _activation_module, _label_maps, _scale_classifier_output

VARIANTS = ("v3", "v2", "absolute")


def deberta_config(variant: str, vocab_size: int):
    from transformers import DebertaV2Config

    common = dict(
        TINY_ENCODER,
        vocab_size=vocab_size,
        layer_norm_eps=1e-7,
        max_position_embeddings=512,
        pad_token_id=0,
        relative_attention=True,
        pooler_hidden_act="gelu",
        pooler_dropout=0.0,
    )
    if variant == "v3":
        return DebertaV2Config(
            position_buckets=16,
            max_relative_positions=64,
            share_att_key=True,
            pos_att_type="p2c|c2p",
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            type_vocab_size=0,
            **common,
        )
    if variant in ("v2", "absolute"):
        common["relative_attention"] = variant == "v2"
        return DebertaV2Config(
            max_relative_positions=32,
            share_att_key=False,
            pos_att_type="c2p|p2c",
            position_biased_input=True,
            type_vocab_size=2,
            **common,
        )
    raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")


def _saved(model, tokenizer, out: Path) -> Path:
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def build_deberta_embedder(
    tmp_dir: Path | str, variant: str, pooling: str, seed: int = 0, max_seq_length: int = 128
) -> Path:
    """A sentence-transformers embedder (Transformer + Pooling) over a random DebertaV2Model."""
    import torch
    from transformers import AutoModel

    name = f"tiny-deberta-{variant}-{pooling}-s{seed}-L{max_seq_length}"
    out, hf_dir = Path(tmp_dir) / name, Path(tmp_dir) / f"{name}-hf"
    tokenizer = _bundled_tokenizer(max_seq_length)
    torch.manual_seed(seed)
    model = AutoModel.from_config(deberta_config(variant, len(tokenizer))).eval()
    _perturb_constant_parameters(model, seed)
    _saved(model, tokenizer, hf_dir)
    _save_sentence_transformer(hf_dir, out, pooling, max_seq_length, None)
    return out


def _classifier(variant: str, tokenizer, seed: int, labels: dict, head_scale: float):
    import torch
    from transformers import AutoModelForSequenceClassification

    config = deberta_config(variant, len(tokenizer))
    for key, value in labels.items():
        setattr(config, key, value)
    config.num_labels = len(labels["id2label"])
    config.architectures = ["DebertaV2ForSequenceClassification"]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    _perturb_constant_parameters(model, seed)
    _scale_classifier_output(model, head_scale)
    # The pooler's gelu leaves random logits far from 0 (sigmoid scores all near 1): center them.
    _center_head(model, tokenizer)
    return model


def build_deberta_cross_encoder(
    tmp_dir: Path | str, variant: str, num_labels: int = 1, seed: int = 0, max_seq_length: int = 128
) -> Path:
    """A sentence-transformers CrossEncoder over a random DebertaV2ForSequenceClassification: a reranker
    (1 label, sigmoid) or a classifier (3 labels named negative / neutral / positive)."""
    from sentence_transformers import CrossEncoder

    name = f"tiny-ce-deberta-{variant}-s{seed}-n{num_labels}-L{max_seq_length}"
    out, hf_dir = Path(tmp_dir) / name, Path(tmp_dir) / f"{name}-hf"
    tokenizer = _bundled_tokenizer(max_seq_length)
    model = _classifier(variant, tokenizer, seed, _label_maps(num_labels), CROSS_ENCODER_HEAD_SCALE)
    _saved(model, tokenizer, hf_dir)
    CrossEncoder(str(hf_dir), device="cpu", activation_fn=_activation_module(None)).save(
        str(out), create_model_card=False
    )
    return out


def build_deberta_nli(
    tmp_dir: Path | str,
    variant: str = "v3",
    labels: tuple[str, ...] = ("entailment", "neutral", "contradiction"),
    seed: int = 0,
    max_seq_length: int = 128,
) -> Path:
    """A zero-shot NLI classifier saved as transformers saves one; labels in the MoritzLaurer models' order."""
    name = f"tiny-nli-deberta-{variant}-s{seed}-L{max_seq_length}-{'-'.join(labels)}"
    tokenizer = _bundled_tokenizer(max_seq_length)
    label_maps = {"id2label": dict(enumerate(labels)), "label2id": {label: i for i, label in enumerate(labels)}}
    model = _classifier(variant, tokenizer, seed, label_maps, NLI_HEAD_SCALE)
    return _saved(model, tokenizer, Path(tmp_dir) / name)
