"""Random-weight *ForTokenClassification models of every encoder family that serves them, for the token
classification parity tests, and their transformers references.

Each uses the bundled all-MiniLM-L6-v2 WordPiece tokenizer (saved beside the weights; nothing is downloaded),
the tiny configs the families' own parity tests use, and NER-style labels (B-/I- tags and O) so that the
pipeline's grouping has tags to join. Norm weights and biases are random so that loading mistakes show.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.classic_models import classic_config
from tests.helpers.deberta_models import deberta_config
from tests.helpers.models import _bundled_tokenizer, _config, _perturb_constant_parameters
from tests.helpers.modernbert_models import modernbert_config

TOKEN_CLASSIFIER_ARCHS = (
    "bert",
    "roberta",
    "xlm-roberta",
    "distilbert",
    "electra",
    "mpnet",
    "deberta-v2",
    "modernbert",
)
NER_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC")

# Words of several WordPiece pieces, punctuation inside words, an unknown character and texts of different
# lengths, so that FIRST, AVERAGE and MAX can differ and a batch mixes lengths.
NER_TEXTS = [
    "Anneliese Kowalczyk joined Microsoft in Wrocław last Thursday.",
    "Xylophonists from Reykjavík photosynthesize ☃ unbelievably well-known melodies.",
    "Hi",
    "Dr. Oluwaseun Adebayo-Okonkwo works at the Massachusetts Institute of Technology, near Cambridgeport, "
    "and lectures on thermodynamics, electromagnetism and quantumchromodynamics to undergraduates.",
    "The Bundesverfassungsgericht in Karlsruhe ruled.",
]


def token_classifier_config(arch: str, vocab_size: int):
    """The tiny config of `arch` the family's parity tests use."""
    if arch in ("bert", "roberta", "xlm-roberta"):
        return _config(arch, vocab_size)
    if arch in ("distilbert", "electra", "mpnet"):
        return classic_config(arch, vocab_size)
    if arch == "deberta-v2":
        return deberta_config("v3", vocab_size)
    if arch == "modernbert":
        # With biases, so the prediction head's optional ones are read too.
        return modernbert_config(vocab_size, biases=True)
    raise ValueError(f"arch must be one of {TOKEN_CLASSIFIER_ARCHS}, not {arch!r}")


def bpe_tokenizer(max_seq_length: int):
    """A small BPE tokenizer trained here (no continuing-subword prefix, no decoder): the tokenizers for which
    the pipeline guesses words from spaces, as it does for RoBERTa's or XLM-R's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from benchmarks.corpus import stdlib_texts

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    backend = Tokenizer(models.BPE(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.train_from_iterator(stdlib_texts(200, seed=3), trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        model_max_length=max_seq_length,
    )


def build_token_classifier(
    tmp_dir: Path | str, arch: str, seed: int = 0, max_seq_length: int = 128, tokenizer: str = "wordpiece"
) -> Path:
    """A random-weight `arch`ForTokenClassification directory with NER_LABELS and the bundled WordPiece
    tokenizer, or (tokenizer "bpe") bpe_tokenizer's; its path."""
    import torch
    from transformers import AutoModelForTokenClassification

    out = Path(tmp_dir) / f"tiny-token-classifier-{arch}-{tokenizer}-s{seed}"
    tokenizer = _bundled_tokenizer(max_seq_length) if tokenizer == "wordpiece" else bpe_tokenizer(max_seq_length)
    config = token_classifier_config(arch, len(tokenizer))
    config.num_labels = len(NER_LABELS)
    config.id2label = dict(enumerate(NER_LABELS))
    config.label2id = {label: i for i, label in enumerate(NER_LABELS)}
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(config, attn_implementation="eager").eval()
    _perturb_constant_parameters(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def token_logits_reference(model_dir: Path, texts: list[str]) -> list:
    """transformers' logits [tokens, labels] per text, each run alone (float32), as numpy arrays."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForTokenClassification.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text, return_tensors="pt", truncation=True)
            out.append(model(**inputs).logits[0].float().numpy())
    return out


def pipeline_entities(model_dir: Path, texts: list[str], strategy: str, ignore_labels=None) -> list[list[dict]]:
    """transformers' pipeline("token-classification") on the same weights, one list of entities per text."""
    import warnings

    from transformers import AutoModelForTokenClassification, AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForTokenClassification.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    kwargs = {} if ignore_labels is None else {"ignore_labels": list(ignore_labels)}
    classify = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy=strategy)
    with warnings.catch_warnings():
        # "Tokenizer does not support real words": the heuristic the pipeline falls back to is what we compare.
        warnings.simplefilter("ignore", UserWarning)
        return [classify(text, **kwargs) for text in texts]
