"""Scoring models for tests: random-weight cross-encoders, decoder classifiers and a Qwen3-Reranker-style
causal LM, plus reference scores computed with transformers / sentence-transformers.

Like the encoders in models.py, every model uses the bundled all-MiniLM-L6-v2 WordPiece tokenizer, so
nothing is downloaded. With a qwen3 (or llama) config AutoTokenizer keeps it a BertTokenizer, which
lowercases and drops newlines, and adds [CLS]/[SEP] around the middle text of the reranker prompt;
the references below simply run whatever AutoTokenizer gives, as the model card code would.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.helpers.models import (
    _bundled_tokenizer,
    _config,
    _perturb_constant_parameters,
    build_tiny_generator,
    save_random_decoder,
)

CROSS_ENCODER_ARCHS = ("bert", "roberta", "xlm-roberta")
CLASSIFIER_DECODER_ARCHS = ("llama", "qwen2", "qwen3")
ACTIVATIONS = ("identity", "sigmoid", "tanh")
# Pairs sharing a query differ little in the pooled [CLS] state (random logits of std ~0.2 across documents);
# a larger output layer spreads the scores over the sigmoid's range without saturating it.
CROSS_ENCODER_HEAD_SCALE = 3.0

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _label_maps(num_labels: int) -> dict:
    """Distinct label names for 3 labels (so a server reading id2label can be checked), generic otherwise.

    transformers 5 leaves the default two-label map out of config.json, so 2-label configs carry neither
    id2label nor num_labels: loaders must fall back to 2, as transformers does.
    """
    names = ["negative", "neutral", "positive"] if num_labels == 3 else [f"LABEL_{i}" for i in range(num_labels)]
    return {"id2label": dict(enumerate(names)), "label2id": {name: i for i, name in enumerate(names)}}


def _activation_module(activation: str | None):
    import torch

    if activation is None:
        return None  # sentence-transformers' default: Sigmoid for one label, Identity otherwise
    modules = {"identity": torch.nn.Identity, "sigmoid": torch.nn.Sigmoid, "tanh": torch.nn.Tanh}
    if activation not in modules:
        raise ValueError(f"activation must be one of {ACTIVATIONS} or None, not {activation!r}")
    return modules[activation]()


def _scale_classifier_output(model, factor: float) -> None:
    """Scale the last layer of the classification head (BERT `classifier`, RoBERTa `classifier.out_proj`)."""
    import torch

    head = model.classifier
    layer = head.out_proj if hasattr(head, "out_proj") else head
    with torch.no_grad():
        layer.weight.mul_(factor)


def build_cross_encoder(
    tmp_dir: Path | str,
    arch: str,
    seed: int = 0,
    num_labels: int = 1,
    max_seq_length: int = 128,
    multi_label: bool = False,
    activation: str | None = None,
) -> Path:
    """Build and save a random-weight sentence-transformers CrossEncoder (BERT/RoBERTa/XLM-R); return its dir.

    `activation` ("identity", "sigmoid", "tanh") is stored as activation_fn in config_sentence_transformers.json;
    None keeps sentence-transformers' default. `multi_label` sets problem_type to multi_label_classification.
    """
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification

    if arch not in CROSS_ENCODER_ARCHS:
        raise ValueError(f"arch must be one of {CROSS_ENCODER_ARCHS}, not {arch!r}")
    name = f"tiny-ce-{arch}-s{seed}-n{num_labels}-L{max_seq_length}"
    name += ("-multilabel" if multi_label else "") + (f"-{activation}" if activation else "")
    out = Path(tmp_dir) / name
    hf_dir = Path(tmp_dir) / f"{name}-hf"

    tokenizer = _bundled_tokenizer(max_seq_length)
    config = _config(arch, vocab_size=len(tokenizer))
    # The copied BERT tokenizer returns token_type_ids and gives the second text of a pair type id 1;
    # RoBERTa's single token type would make transformers (and CrossEncoder) index out of range on pairs.
    config.type_vocab_size = 2
    config.num_labels = num_labels
    for key, value in _label_maps(num_labels).items():
        setattr(config, key, value)
    if multi_label:
        config.problem_type = "multi_label_classification"

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    _scale_classifier_output(model, CROSS_ENCODER_HEAD_SCALE)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))

    cross_encoder = CrossEncoder(str(hf_dir), device="cpu", activation_fn=_activation_module(activation))
    cross_encoder.save(str(out), create_model_card=False)
    return out


def build_decoder_classifier(
    tmp_dir: Path | str,
    arch: str,
    seed: int = 0,
    num_labels: int = 1,
    max_seq_length: int = 128,
    pad_token_id: int = 0,
    **config_overrides,
) -> Path:
    """Build and save a random-weight Llama/Qwen2/Qwen3 ForSequenceClassification; return its directory.

    transformers scores the last token that is not `pad_token_id`. Other keyword arguments go into the
    Hugging Face config.
    """
    from transformers import AutoModelForSequenceClassification

    if arch not in CLASSIFIER_DECODER_ARCHS:
        raise ValueError(f"arch must be one of {CLASSIFIER_DECODER_ARCHS}, not {arch!r}")
    digest = hashlib.sha1(repr(sorted(config_overrides.items())).encode()).hexdigest()[:10]
    name = f"tiny-{arch}-cls-s{seed}-n{num_labels}-L{max_seq_length}-p{pad_token_id}-{digest}"
    config_overrides.update(_label_maps(num_labels))
    return save_random_decoder(
        tmp_dir,
        name,
        arch,
        seed,
        max_seq_length,
        AutoModelForSequenceClassification,
        num_kv_heads=2,
        pad_token_id=pad_token_id,
        num_labels=num_labels,
        **config_overrides,
    )


def build_decoder_reranker(
    tmp_dir: Path | str,
    arch: str = "qwen3",
    seed: int = 0,
    max_seq_length: int = 256,
    tie_word_embeddings: bool = False,
    name: str = "tiny-qwen3-reranker",
) -> Path:
    """Build and save a random-weight causal LM shaped like Qwen3-Reranker (yes/no logits); return its dir.

    The directory name starts with `name`, which must contain "reranker": that is how the server tells a
    Qwen3-Reranker-style model from a plain causal LM.
    """
    from transformers import AutoModelForCausalLM

    if "reranker" not in name.lower():
        raise ValueError(f"name must contain 'reranker', not {name!r}")
    dir_name = f"{name}-{arch}-s{seed}-L{max_seq_length}" + ("-tied" if tie_word_embeddings else "")
    return save_random_decoder(
        tmp_dir,
        dir_name,
        arch,
        seed,
        max_seq_length,
        AutoModelForCausalLM,
        num_kv_heads=2,
        tie_word_embeddings=tie_word_embeddings,
    )


def _qwen3_reranker_yes_no_logits(model_dir, query, documents, instruction, max_length):
    """[n, 2] float32 logits of ("no", "yes") at the last prompt token, as the Qwen3-Reranker model card runs it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=torch.float32
    ).eval()
    instruction = QWEN3_RERANKER_INSTRUCTION if instruction is None else instruction
    max_length = tokenizer.model_max_length if max_length is None else max_length
    prefix_tokens = tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    no_id = tokenizer.convert_tokens_to_ids("no")
    yes_id = tokenizer.convert_tokens_to_ids("yes")

    rows = []
    for doc in documents:
        text = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
        # Special tokens as tokenizer() adds them by default, like the model card.
        ids = tokenizer(
            text,
            truncation="longest_first",
            max_length=max_length - len(prefix_tokens) - len(suffix_tokens),
            padding=False,
        )["input_ids"]
        input_ids = torch.tensor([prefix_tokens + ids + suffix_tokens])
        # One pair per forward pass: no padding, so no padding-side or mask subtleties.
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0, -1]
        rows.append(torch.stack([logits[no_id], logits[yes_id]]))
    return torch.stack(rows).float() if rows else torch.zeros((0, 2))


def qwen3_reranker_reference(
    model_dir, query: str, documents: list[str], instruction: str | None = None, max_length: int | None = None
):
    """Qwen3-Reranker relevance scores P("yes") for each document (float32 numpy array)."""
    import torch

    logits = _qwen3_reranker_yes_no_logits(model_dir, query, documents, instruction, max_length)
    # log_softmax then exp, as the model card computes it.
    return torch.nn.functional.log_softmax(logits, dim=1)[:, 1].exp().numpy().astype("float32")


def qwen3_reranker_reference_logits(
    model_dir, query: str, documents: list[str], instruction: str | None = None, max_length: int | None = None
):
    """Raw logit("yes") - logit("no") for each document (float32 numpy array); sigmoid of it is the score."""
    logits = _qwen3_reranker_yes_no_logits(model_dir, query, documents, instruction, max_length)
    return (logits[:, 1] - logits[:, 0]).numpy().astype("float32")


def classifier_reference(model_dir, texts: list[str] | None, pairs: list[tuple[str, str]] | None = None):
    """[n, num_labels] float32 logits from AutoModelForSequenceClassification, one input per forward pass.

    Rows are `texts` then `pairs` (text, text_pair), tokenized with truncation=True. Works on cross-encoder
    directories and decoder classifiers (where transformers picks the last non-pad token itself).
    """
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=torch.float32
    ).eval()
    # Only encoders have token type embeddings; decoders get the copied BERT tokenizer's token_type_ids too.
    keep = {"input_ids", "attention_mask"}
    if hasattr(model.config, "type_vocab_size"):
        keep.add("token_type_ids")
    inputs = [(text,) for text in texts or []] + [tuple(pair) for pair in pairs or []]
    rows = []
    for args in inputs:
        encoded = tokenizer(*args, truncation=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(**{key: value for key, value in encoded.items() if key in keep}).logits[0]
        rows.append(logits.float().numpy())
    if not rows:
        return np.zeros((0, model.config.num_labels), dtype=np.float32)
    return np.stack(rows).astype(np.float32)


def every_task_models(root: Path, embedder_dir: Path, names: tuple[str, str, str, str]) -> dict[str, Path]:
    """One model per task, by served name: `embedder_dir` (embed), a BERT cross-encoder (rerank), a
    3-label XLM-R classifier (classify) and a tiny Llama (generate). `names` in that order."""
    embedder, cross, classifier, generator = names
    return {
        embedder: embedder_dir,
        cross: build_cross_encoder(root, "bert"),
        classifier: build_cross_encoder(root, "xlm-roberta", num_labels=3),
        generator: build_tiny_generator(root, "llama", seed=5),
    }
