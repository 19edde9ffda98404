"""Small random-weight encoder-decoder models for tests: T5 / MT5, BART / mBART, a BART NLI classifier, a
monoT5 reranker and a sentence-T5 embedder.

Each builder saves a Hugging Face directory (seeded random weights, float32 safetensors, `save_pretrained`)
with a tokenizer trained here on stdlib docstrings, so nothing is downloaded:
- BART and mBART: byte-level BPE with BART's special tokens (<s>=0, <pad>=1, </s>=2, <unk>=3), encoding
  `<s> A </s>` and pairs `<s> A </s></s> B </s>` (transformers' BartTokenizer). mBART's own tokenizer is a
  SentencePiece model with language codes; the byte-level one stands in for it here.
- T5: Unigram (<pad>=0, </s>=1, <unk>=2) appending `</s>`, with the pieces "▁true" and "▁false" monoT5 reads.

BART's weights are drawn wider than transformers' default; norm weights, biases, T5's relative position
bias (drawn tiny) and BART's final_logits_bias are made random. Different inputs then give clearly
different outputs, and a tensor loaded into the wrong place shows, while logits stay a few units large
so that float32 rounding is far below the parity tests' tolerance.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

T5_VARIANTS = ("v1.0", "v1.1")
BART_SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")
T5_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")
# Sentinel tokens (<extra_id_N>) the T5 tokenizer appends after its vocabulary, as T5's do (100 there).
T5_EXTRA_IDS = 8
NLI_LABELS = {0: "contradiction", 1: "neutral", 2: "entailment"}
_BPE_VOCAB_SIZE = 600
_UNIGRAM_VOCAB_SIZE = 600
# T5's feed-forward per variant: v1.0 ReLU (wi, wo), v1.1 / Flan-T5 / mT5 gated GELU (wi_0, wi_1, wo).
_FEED_FORWARD = {"v1.0": "relu", "v1.1": "gated-gelu"}


def _training_texts() -> list[str]:
    from benchmarks.corpus import stdlib_texts

    # monoT5's prompt ("Query: ... Document: ... Relevant:") and its answers, so they are whole pieces.
    extra = [
        f"Query: {q} Document: {d} Relevant: {a}"
        for q, d, a in (
            ("what is a socket", "A socket is an endpoint for sending or receiving data.", "true"),
            ("how to parse json", "The calendar module prints calendars.", "false"),
            ("is it true", "It is false, and it is not true.", "false"),
        )
    ] * 20
    return stdlib_texts(400, seed=7) + extra


@functools.lru_cache(maxsize=1)
def _bpe_vocab_and_merges() -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]:
    """A byte-level BPE trained on the texts: (vocab as (token, id) pairs, merges as (left, right) pairs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        special_tokens=[*list(BART_SPECIAL_TOKENS), "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(), trainer)
    state = json.loads(tokenizer.to_str())["model"]
    vocab = tuple(sorted(state["vocab"].items(), key=lambda item: item[1]))
    merges = tuple(tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"])
    return vocab, merges


@functools.lru_cache(maxsize=1)
def _unigram_vocab() -> tuple[tuple[str, float], ...]:
    """A Unigram vocabulary trained on the texts, T5's specials first, "▁true" and "▁false" included."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    trainer = trainers.UnigramTrainer(
        vocab_size=_UNIGRAM_VOCAB_SIZE, special_tokens=list(T5_SPECIAL_TOKENS), unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(_training_texts(), trainer)
    pieces = [(piece, float(score)) for piece, score in json.loads(tokenizer.to_str())["model"]["vocab"]]
    if [p for p, _ in pieces[:3]] != list(T5_SPECIAL_TOKENS):
        raise RuntimeError(f"the Unigram trainer put {pieces[:3]} first, not {T5_SPECIAL_TOKENS}")
    lowest = min(score for _, score in pieces[3:])
    for word in ("▁true", "▁false"):
        if word not in {p for p, _ in pieces}:
            pieces.append((word, lowest))
    return tuple(pieces)


def save_bart_tokenizer(out: Path | str, model_max_length: int = 126):
    """BartTokenizer (transformers 5: the RoBERTa byte-level BPE) over the trained vocabulary; returns it."""
    from transformers import BartTokenizer

    vocab, merges = _bpe_vocab_and_merges()
    tokenizer = BartTokenizer(vocab=dict(vocab), merges=list(merges), model_max_length=model_max_length)
    tokenizer.save_pretrained(str(out))
    return tokenizer


def save_t5_tokenizer(out: Path | str, model_max_length: int = 512):
    """T5Tokenizer (Unigram) over the trained vocabulary plus T5_EXTRA_IDS sentinels; returns it."""
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer(vocab=list(_unigram_vocab()), extra_ids=T5_EXTRA_IDS, model_max_length=model_max_length)
    tokenizer.save_pretrained(str(out))
    return tokenizer


def _check_tokenizer(out: Path, built) -> int:
    """AutoTokenizer must load what we saved and tokenize as the tokenizer we built; returns its length."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(out))
    samples = ["Return the JSON object.", "Query: is it true Document: it is false. Relevant:", "  odd   spacing é"]
    for text in samples:
        if loaded(text)["input_ids"] != built(text)["input_ids"]:
            raise RuntimeError(f"{out}: AutoTokenizer tokenizes {text!r} differently from the tokenizer we built")
    pair = loaded("a question", "an answer")["input_ids"]
    if pair != built("a question", "an answer")["input_ids"]:
        raise RuntimeError(f"{out}: AutoTokenizer encodes pairs differently from the tokenizer we built")
    return len(loaded)


def _perturb(model, seed: int, extra_names: tuple[str, ...] = ()) -> None:
    """Norm weights start at 1, biases at 0: make them random so loading mistakes show. Also scales up
    T5's relative position bias (drawn tiny) so that distances matter."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "relative_attention_bias" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
            elif "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
        for name, buffer in model.named_buffers():
            if name.split(".")[-1] in extra_names:
                buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype))


def _vocab_size(tokenizer_length: int) -> int:
    # Checkpoints round their vocabulary up (T5's 32128 > 32100 pieces): rows no token uses are normal.
    return -(-tokenizer_length // 8) * 8 + 8


def _t5_config(vocab_size: int, variant: str, tied: bool, mt5: bool, **overrides):
    from transformers import MT5Config, T5Config

    if variant not in T5_VARIANTS:
        raise ValueError(f"variant must be one of {T5_VARIANTS}, not {variant!r}")
    config = dict(
        vocab_size=vocab_size,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        # Short, so that test inputs have distances past it (the bucket then stops changing).
        relative_attention_max_distance=20,
        feed_forward_proj=_FEED_FORWARD[variant],
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        initializer_factor=1.0,
        decoder_start_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    config.update(overrides)
    return (MT5Config if mt5 else T5Config)(**config)


def _write_hub_style_t5_config(out: Path, tied: bool) -> None:
    """config.json as the hub's T5 checkpoints have it (written by transformers 4): `tie_word_embeddings`
    says whether the LM head is the embedding matrix (and, for T5, whether the decoder output is scaled by
    d_model**-0.5); transformers 5's `scale_decoder_outputs` is not there."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.pop("scale_decoder_outputs", None)
    config["tie_word_embeddings"] = tied
    path.write_text(json.dumps(config, indent=2))


def _untie_lm_head(model, seed: int) -> None:
    """transformers 5 ties T5's LM head to the embeddings at construction; give it weights of its own.

    Drawn with std d_model**-0.5 (transformers draws 1.0): logits of a few units, as a tied head's with the
    d_model**-0.5 output scale, so that float32 rounding stays far below the tests' tolerance."""
    import torch

    generator = torch.Generator().manual_seed(seed + 2000)
    weight = model.lm_head.weight
    std = model.config.d_model**-0.5
    model.lm_head.weight = torch.nn.Parameter(std * torch.randn(weight.shape, generator=generator))


def build_tiny_t5(
    tmp_dir: Path | str,
    name: str | None = None,
    seed: int = 0,
    variant: str = "v1.0",
    tied: bool = True,
    mt5: bool = False,
    **config_overrides,
) -> Path:
    """A random T5ForConditionalGeneration (MT5ForConditionalGeneration with `mt5`) directory.

    v1.0: ReLU feed-forward (DenseReluDense.wi / wo); v1.1 (Flan-T5, mT5): gated GELU (wi_0, wi_1, wo).
    `tied`: the LM head is `shared.weight` (no lm_head.weight saved) and config.json says
    tie_word_embeddings true; untied saves lm_head.weight and says false, as v1.1 checkpoints do.
    """
    import torch
    from transformers import MT5ForConditionalGeneration, T5ForConditionalGeneration

    kind = "mt5" if mt5 else "t5"
    name = name or f"tiny-{kind}-{variant}-{'tied' if tied else 'untied'}-s{seed}"
    out = Path(tmp_dir) / name
    if (out / "config.json").exists():
        return out
    built = save_t5_tokenizer(out)
    vocab_size = _vocab_size(_check_tokenizer(out, built))
    config = _t5_config(vocab_size, variant, tied, mt5, **config_overrides)
    torch.manual_seed(seed)
    model_class = MT5ForConditionalGeneration if mt5 else T5ForConditionalGeneration
    model = model_class(config).eval()
    if not tied:
        _untie_lm_head(model, seed)
        model.config.tie_word_embeddings = False
    _perturb(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    _write_hub_style_t5_config(out, tied)
    return out


def build_tiny_monot5(tmp_dir: Path | str, name: str = "tiny-monot5", seed: int = 0, **config_overrides) -> Path:
    """A monoT5-style reranker: a T5 v1.0 (tied, as castorini's monoT5 on t5-base) in a directory named monot5.

    It scores `Query: q Document: d Relevant:` by logit("▁true") - logit("▁false") at the first decoder step.
    """
    if "monot5" not in name.lower():
        raise ValueError(f"a monoT5 directory name must contain 'monot5', not {name!r}")
    return build_tiny_t5(tmp_dir, name=name, seed=seed, variant="v1.0", tied=True, **config_overrides)


def t5_true_false_ids(model_dir: Path | str) -> tuple[int, int]:
    """The ids of "▁true" and "▁false" in a T5 directory's vocabulary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.convert_tokens_to_ids(["▁true", "▁false"])
    if tokenizer.unk_token_id in ids:
        raise RuntimeError(f"{model_dir}: the vocabulary lacks ▁true or ▁false")
    return ids[0], ids[1]


def _bart_config(vocab_size: int, mbart: bool, **overrides):
    from transformers import BartConfig, MBartConfig

    config = dict(
        vocab_size=vocab_size,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=128,
        activation_function="gelu",
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        classifier_dropout=0.0,
        # Wider than the default 0.02, so that random outputs of different texts are well separated.
        init_std=0.15,
        # mBART scales its embeddings by sqrt(d_model) (as mbart-large-cc25); bart-large does not.
        scale_embedding=mbart,
        bos_token_id=0,
        pad_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
    )
    config.update(overrides)
    return (MBartConfig if mbart else BartConfig)(**config)


def _save_bart(tmp_dir, name: str, seed: int, mbart: bool, model_class_name: str, **config_overrides) -> Path:
    import torch
    import transformers

    out = Path(tmp_dir) / name
    if (out / "config.json").exists():
        return out
    built = save_bart_tokenizer(out, model_max_length=config_overrides.get("max_position_embeddings", 128) - 2)
    vocab_size = _vocab_size(_check_tokenizer(out, built))
    config = _bart_config(vocab_size, mbart, **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class_name)(config).eval()
    _perturb(model, seed, extra_names=("final_logits_bias",))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def build_tiny_bart(
    tmp_dir: Path | str, name: str | None = None, seed: int = 0, mbart: bool = False, **config_overrides
) -> Path:
    """A random BartForConditionalGeneration (MBartForConditionalGeneration with `mbart`) directory.

    BART: post-LN layers, embeddings unscaled (pass scale_embedding=True to scale them); mBART: pre-LN
    layers with a final layer_norm per stack, embeddings scaled by sqrt(d_model).
    """
    kind = "mbart" if mbart else "bart"
    suffix = _overrides_suffix(config_overrides)
    name = name or f"tiny-{kind}-s{seed}{suffix}"
    model_class = "MBartForConditionalGeneration" if mbart else "BartForConditionalGeneration"
    return _save_bart(tmp_dir, name, seed, mbart, model_class, **config_overrides)


def build_tiny_bart_nli(tmp_dir: Path | str, name: str = "tiny-bart-nli", seed: int = 0, **config_overrides) -> Path:
    """A random BartForSequenceClassification with the NLI labels of bart-large-mnli."""
    config_overrides.setdefault("id2label", dict(NLI_LABELS))
    config_overrides.setdefault("label2id", {label: i for i, label in NLI_LABELS.items()})
    return _save_bart(tmp_dir, name, seed, False, "BartForSequenceClassification", **config_overrides)


def _overrides_suffix(overrides: dict) -> str:
    if not overrides:
        return ""
    import hashlib

    return "-" + hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:8]


def build_tiny_sentence_t5(
    tmp_dir: Path | str,
    name: str | None = None,
    seed: int = 0,
    max_seq_length: int = 128,
    classic_module_types: bool = True,
    **config_overrides,
) -> Path:
    """A sentence-T5 / GTR-style embedder as sentence-transformers saves it: T5EncoderModel weights at the
    root (architectures ["T5EncoderModel"]), then Pooling (mean), Dense 64 -> 64 without bias or activation
    (2_Dense), Normalize.

    `classic_module_types` names the modules in modules.json as the published sentence-t5 / GTR models do
    (`sentence_transformers.models.Dense`, ...); without it they keep the installed version's names."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    from transformers import T5EncoderModel

    name = name or f"tiny-sentence-t5-s{seed}-L{max_seq_length}" + ("" if classic_module_types else "-st")
    out = Path(tmp_dir) / name
    if (out / "modules.json").exists():
        return out
    hf_dir = Path(tmp_dir) / f"{name}-hf"
    built = save_t5_tokenizer(hf_dir, model_max_length=max_seq_length)
    vocab_size = _vocab_size(_check_tokenizer(hf_dir, built))
    config = _t5_config(vocab_size, "v1.0", True, False, **config_overrides)
    torch.manual_seed(seed)
    model = T5EncoderModel(config).eval()
    _perturb(model, seed)
    model.save_pretrained(str(hf_dir), safe_serialization=True)

    transformer = Transformer(str(hf_dir), max_seq_length=max_seq_length)
    dimension = transformer.get_embedding_dimension()
    generator = torch.Generator().manual_seed(seed + 3000)
    dense = Dense(dimension, dimension, bias=False, activation_function=torch.nn.Identity())
    with torch.no_grad():
        dense.linear.weight.copy_(torch.randn(dense.linear.weight.shape, generator=generator) * dimension**-0.5)
    st = SentenceTransformer(
        modules=[transformer, Pooling(dimension, pooling_mode="mean"), dense, Normalize()], device="cpu"
    )
    st.save(str(out), create_model_card=False)
    shutil.rmtree(hf_dir)
    if classic_module_types:
        modules = json.loads((out / "modules.json").read_text())
        for module in modules:
            module["type"] = "sentence_transformers.models." + module["type"].rsplit(".", 1)[-1]
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
    if not (out / "2_Dense").is_dir() or not list(out.glob("*.safetensors")):
        saved = sorted(p.name for p in out.iterdir())
        raise RuntimeError(f"{out}: sentence-transformers did not save 2_Dense and the weights: {saved}")
    architectures = json.loads((out / "config.json").read_text()).get("architectures")
    if architectures != ["T5EncoderModel"]:
        raise RuntimeError(f"{out}: config.json names {architectures}, not T5EncoderModel")
    return out
