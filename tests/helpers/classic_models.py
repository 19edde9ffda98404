"""Random-weight MPNet, DistilBERT and ELECTRA models for the parity tests: sentence-transformers embedders
(with an optional Dense module, as distiluse-base-multilingual-cased has) and ForSequenceClassification
cross-encoders.

Like every test model they use the bundled all-MiniLM-L6-v2 WordPiece tokenizer (nothing is downloaded);
both our engine and the references load it through AutoTokenizer. Norm weights and biases are made random
(tests/helpers/models._perturb_constant_parameters) so loading mistakes show.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.helpers.models import _bundled_tokenizer, _perturb_constant_parameters, _save_sentence_transformer
from tests.helpers.nli_models import _center_head
from tests.helpers.scorers import CROSS_ENCODER_HEAD_SCALE, _label_maps, _scale_classifier_output

CLASSIC_ARCHS = ("mpnet", "distilbert", "electra")
# MPNet's relative bias starts as an Embedding of std initializer_range; larger, it moves the attention of
# the tiny models enough that a wrong bucket or a wrong scale shows in the outputs.
MPNET_BIAS_SCALE = 8.0


def classic_config(arch: str, vocab_size: int, **overrides):
    """A tiny config of `arch` (hidden 64, 2 layers, 4 heads); `overrides` go into it."""
    from transformers import DistilBertConfig, ElectraConfig, MPNetConfig

    if arch == "distilbert":
        common = dict(
            vocab_size=vocab_size,
            dim=64,
            n_layers=2,
            n_heads=4,
            hidden_dim=128,
            activation="gelu",
            max_position_embeddings=512,
            dropout=0.0,
            attention_dropout=0.0,
            initializer_range=0.15,
            pad_token_id=0,
        )
        return DistilBertConfig(**(common | overrides))
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_act="gelu",
        initializer_range=0.15,
        layer_norm_eps=1e-12,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if arch == "mpnet":
        # Positions start after MPNet's padding index 1: 514 positions hold 512 tokens.
        return MPNetConfig(max_position_embeddings=514, pad_token_id=1, **(common | overrides))
    if arch == "electra":
        # Narrower embeddings than layers, as ELECTRA-small has: the embeddings_project path.
        electra = dict(embedding_size=32, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0)
        return ElectraConfig(**(common | electra | overrides))
    raise ValueError(f"arch must be one of {CLASSIC_ARCHS}, not {arch!r}")


def _randomize(model, seed: int) -> None:
    import torch

    _perturb_constant_parameters(model, seed)
    base = getattr(model, "base_model", model)
    encoder = getattr(base, "encoder", None)
    if encoder is not None and hasattr(encoder, "relative_attention_bias"):
        with torch.no_grad():
            encoder.relative_attention_bias.weight.mul_(MPNET_BIAS_SCALE)


def _name(prefix: str, arch: str, seed: int, max_seq_length: int, options) -> str:
    digest = hashlib.sha1(repr(options).encode()).hexdigest()[:10]
    return f"{prefix}-{arch}-s{seed}-L{max_seq_length}-{digest}"


def build_classic_encoder(
    tmp_dir: Path | str,
    arch: str,
    pooling: str,
    seed: int = 0,
    max_seq_length: int = 128,
    dense: tuple[int, str] | None = None,
    **config_overrides,
) -> Path:
    """A random-weight sentence-transformers embedder of `arch`: Transformer, Pooling (cls or mean), and with
    `dense` = (out_features, "tanh" or "identity") a Dense module after the pooling. Returns its directory."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense
    from transformers import AutoModel

    name = _name("tiny-classic", arch, seed, max_seq_length, (pooling, dense, sorted(config_overrides.items())))
    out, hf_dir = Path(tmp_dir) / name, Path(tmp_dir) / f"{name}-hf"
    tokenizer = _bundled_tokenizer(max_seq_length)
    torch.manual_seed(seed)
    model = AutoModel.from_config(
        classic_config(arch, len(tokenizer), **config_overrides), attn_implementation="eager"
    ).eval()
    _randomize(model, seed)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))
    _save_sentence_transformer(hf_dir, out, pooling, max_seq_length, prompts=None)
    if dense is not None:
        width, activation = dense
        st = SentenceTransformer(str(out), device="cpu")
        activations = {"tanh": torch.nn.Tanh(), "identity": torch.nn.Identity()}
        torch.manual_seed(seed + 1)
        st.append(Dense(st.get_embedding_dimension(), width, activation_function=activations[activation]))
        st.save(str(out), create_model_card=False)
    return out


def build_classic_cross_encoder(
    tmp_dir: Path | str, arch: str, seed: int = 0, num_labels: int = 1, max_seq_length: int = 128, **config_overrides
) -> Path:
    """A random-weight sentence-transformers CrossEncoder over `arch`ForSequenceClassification; its directory."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification

    name = _name("tiny-classic-ce", arch, seed, max_seq_length, (num_labels, sorted(config_overrides.items())))
    out, hf_dir = Path(tmp_dir) / name, Path(tmp_dir) / f"{name}-hf"
    tokenizer = _bundled_tokenizer(max_seq_length)
    config = classic_config(arch, len(tokenizer), num_labels=num_labels, **_label_maps(num_labels), **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    _randomize(model, seed)
    _scale_classifier_output(model, CROSS_ENCODER_HEAD_SCALE)
    # Centered, the scores spread over the sigmoid's middle instead of saturating (DistilBERT's ReLU head
    # gives every pair a logit near 5 otherwise).
    _center_head(model, tokenizer)
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(hf_dir))
    CrossEncoder(str(hf_dir), device="cpu").save(str(out), create_model_card=False)
    return out


# The checks every classic family's parity module runs (float32 unless said).
MIN_COSINE = 0.9999
INT8_MIN_COSINE = 0.99
ATOL = 1e-4


def _sigmoid(x):
    import numpy as np

    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def _softmax(x):
    import numpy as np

    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def check_embeddings(engine, st, texts: list[str], max_seq_length: int, what: str, minimum: float = MIN_COSINE):
    """The engine's embeddings of `texts` (some truncated) equal sentence-transformers' to `minimum` cosine."""
    from embedserv.types import EmbedParams
    from tests.helpers.compare import assert_cosine_at_least
    from tests.helpers.models import reference_token_counts

    counts = reference_token_counts(st, texts)
    assert max(counts) == max_seq_length, "the texts must hold some longer than max_seq_length"
    result = engine.embed(texts, EmbedParams(truncate=True))
    expected = st.encode(texts, convert_to_numpy=True)
    assert result.embeddings.shape == expected.shape
    assert_cosine_at_least(result.embeddings, expected, minimum, texts, what=what)
    assert result.prompt_tokens == sum(counts)
    return result.embeddings


def check_rerank(engine, model_dir, query: str, documents: list[str], max_seq_length: int):
    """Rerank scores equal CrossEncoder.predict (sigmoid) and raw scores transformers' logits, within ATOL."""
    import numpy as np
    from sentence_transformers import CrossEncoder

    from embedserv.types import RerankParams
    from tests.helpers.scorers import classifier_reference

    reference = CrossEncoder(str(model_dir), device="cpu")
    pairs = [(query, d) for d in documents]
    assert max(len(reference.tokenizer(q, d)["input_ids"]) for q, d in pairs) > max_seq_length, "some must truncate"
    expected = reference.predict(pairs)
    logits = classifier_reference(model_dir, None, pairs)[:, 0]
    np.testing.assert_allclose(_sigmoid(logits), expected, atol=ATOL, err_msg="the two references disagree")

    def scores(**params) -> np.ndarray:
        result = engine.rerank(query, documents, RerankParams(truncate=True, **params))
        got = np.full(len(documents), np.nan, dtype=np.float32)
        for ranked in result.results:
            got[ranked.index] = ranked.score
        assert [r.index for r in result.results] == list(np.argsort(-got, kind="stable"))
        return got

    np.testing.assert_allclose(scores(), expected, atol=ATOL)
    np.testing.assert_allclose(scores(raw_scores=True), logits, atol=ATOL)
    assert expected.std() > 0.02, "scores must spread for the comparison to mean something"


def check_classify(engine, model_dir, texts: list[str]):
    """Classify equals transformers' ForSequenceClassification: softmax, and raw logits, within ATOL."""
    import numpy as np

    from embedserv.types import ClassifyParams
    from tests.helpers.scorers import classifier_reference

    logits = classifier_reference(model_dir, texts)
    result = engine.classify(texts, ClassifyParams(truncate=True))
    raw = engine.classify(texts, ClassifyParams(truncate=True, raw_scores=True))
    np.testing.assert_allclose(raw.scores, logits, atol=ATOL)
    np.testing.assert_allclose(result.scores, _softmax(logits), atol=ATOL)
    assert len(set(np.argmax(logits, axis=1))) > 1, "the texts must not all get the same label"
