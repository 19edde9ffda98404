"""Random-weight NLI classifiers for zero-shot classification tests, and transformers' zero-shot pipeline
on them as the reference.

Like every test model, they use the bundled all-MiniLM-L6-v2 WordPiece tokenizer (nothing is downloaded)
and are saved as transformers saves a *ForSequenceClassification checkpoint, with the label names an NLI
model card carries in id2label.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.models import _bundled_tokenizer, _config, _perturb_constant_parameters
from tests.helpers.scorers import _scale_classifier_output

NLI_ARCHS = ("bert", "roberta")
# facebook/bart-large-mnli and roberta-large-mnli order their labels this way.
MNLI_LABELS = ("contradiction", "neutral", "entailment")
# Random weights give every pair nearly the same logits, a few units apart between labels: multi-label
# scores would all sit near 0 or 1. The head is scaled up and then centered on these pairs, so scores
# spread over the middle of the range, where a wrong pair or a wrong label id shows.
NLI_HEAD_SCALE = 10.0
_CENTERING_PAIRS = [
    (premise, f"This example is {label}.")
    for premise in ("A dog ran across the park.", "Prices rose again this quarter.", "It rained all day long.")
    for label in ("sports", "money", "the weather")
]


def _center_head(model, tokenizer) -> None:
    """Shift the head's last bias so the centering pairs' logits average 0 for every label."""
    import torch

    head = model.classifier
    layer = head.out_proj if hasattr(head, "out_proj") else head
    premises, hypotheses = zip(*_CENTERING_PAIRS, strict=True)
    with torch.no_grad():
        logits = model(**tokenizer(list(premises), list(hypotheses), padding=True, return_tensors="pt")).logits
        layer.bias.sub_(logits.mean(dim=0))


def build_nli_classifier(
    tmp_dir: Path | str,
    arch: str = "bert",
    labels: tuple[str, ...] = MNLI_LABELS,
    seed: int = 0,
    max_seq_length: int = 128,
) -> Path:
    """Build and save a random-weight BERT/RoBERTa ForSequenceClassification with these id2label names."""
    import hashlib

    import torch
    from transformers import AutoModelForSequenceClassification

    if arch not in NLI_ARCHS:
        raise ValueError(f"arch must be one of {NLI_ARCHS}, not {arch!r}")
    digest = hashlib.sha1(repr(labels).encode()).hexdigest()[:8]
    out = Path(tmp_dir) / f"tiny-nli-{arch}-s{seed}-L{max_seq_length}-{digest}"

    tokenizer = _bundled_tokenizer(max_seq_length)
    config = _config(arch, vocab_size=len(tokenizer))
    # The copied BERT tokenizer gives the hypothesis of a pair segment id 1 (see scorers.build_cross_encoder).
    config.type_vocab_size = 2
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: index for index, label in enumerate(labels)}
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForSequenceClassification"]

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    _scale_classifier_output(model, NLI_HEAD_SCALE)
    _center_head(model, tokenizer)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def zero_shot_reference(
    model_dir: Path | str,
    texts: list[str],
    candidate_labels: list[str],
    hypothesis_template: str | None = None,
    multi_label: bool = False,
) -> list[dict[str, float]]:
    """transformers' zero-shot-classification pipeline (float32, CPU): per text, label -> score."""
    from transformers import pipeline

    classifier = pipeline("zero-shot-classification", model=str(model_dir), tokenizer=str(model_dir), device="cpu")
    kwargs = {"multi_label": multi_label}
    if hypothesis_template is not None:
        kwargs["hypothesis_template"] = hypothesis_template
    results = classifier(list(texts), candidate_labels=list(candidate_labels), **kwargs)
    if isinstance(results, dict):
        results = [results]
    return [dict(zip(r["labels"], r["scores"], strict=True)) for r in results]
