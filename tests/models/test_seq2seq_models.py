"""Native encoder-decoders (T5, mT5, BART, mBART) and T5 encoders against transformers, in float32.

Each test packs several sequences of different encoder and decoder lengths into one KV-free pass over the
naive backend (decoder self-attention causal, encoder bidirectional, cross-attention by the cross
metadata) and compares every sequence with transformers' own forward of that sequence alone: decoder
logits through our LM head, encoder outputs, the BART NLI head and the monoT5 head. Lengths pass T5's
relative_attention_max_distance (20) in both stacks, so the far buckets are exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.metadata import build_common_metadata, build_cross_metadata
from embedserv.forward_context import ForwardContext, set_forward_context
from embedserv.models import registry
from embedserv.models.families.bart import BartModel
from embedserv.models.families.t5 import T5EncoderModel, T5Model
from embedserv.models.heads.lm import build_lm_head
from embedserv.models.heads.pooling import PoolingInputs
from embedserv.models.heads.score import build_classifier_head, build_seq2seq_yes_no_head
from embedserv.models.interface import ModelKind
from embedserv.models.loading.checkpoint import checkpoint_files
from embedserv.models.loading.hf_config import read_hf_config
from embedserv.models.loading.weights import build_model
from embedserv.worker.layer_routes import forward_context_for
from tests.helpers import seq2seq_models as builders

ATOL = 1e-4
# (encoder tokens, decoder tokens) per packed sequence: a one-token decoder (a first generation step),
# and lengths past T5's max_distance of 20.
LENGTHS = [(9, 1), (45, 7), (2, 26), (30, 13)]
CPU = torch.device("cpu")

# id -> (builder, keyword arguments)
SEQ2SEQ = {
    "t5-v1.0-tied": (builders.build_tiny_t5, dict(variant="v1.0", tied=True)),
    "t5-v1.0-untied": (builders.build_tiny_t5, dict(variant="v1.0", tied=False)),
    "t5-v1.1-tied": (builders.build_tiny_t5, dict(variant="v1.1", tied=True)),
    "t5-v1.1-untied": (builders.build_tiny_t5, dict(variant="v1.1", tied=False)),
    "mt5": (builders.build_tiny_t5, dict(variant="v1.1", tied=False, mt5=True)),
    "mt5-tied": (builders.build_tiny_t5, dict(variant="v1.1", tied=True, mt5=True)),
    "bart": (builders.build_tiny_bart, dict()),
    "bart-scaled-relu": (builders.build_tiny_bart, dict(scale_embedding=True, activation_function="relu")),
    "mbart": (builders.build_tiny_bart, dict(mbart=True)),
}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("seq2seq")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    from benchmarks.corpus import stdlib_texts

    return stdlib_texts(12, seed=3)


def _load_ours(model_dir, architecture: str | None = None, sentence_transformers: bool = False):
    hf_config = read_hf_config(model_dir)
    architecture = architecture or (hf_config.architectures or [""])[0]
    entry = registry.lookup(hf_config.model_type, architecture, sentence_transformers=sentence_transformers)
    files = checkpoint_files(model_dir)
    model = build_model(entry, hf_config, files, CPU, torch.float32)
    return model, hf_config, files, entry


def _token_batches(model_dir, texts, decoder_start: int):
    """Per sequence (encoder ids, decoder ids): real texts, cut to LENGTHS; decoders start with `decoder_start`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pairs = []
    for i, (enc_len, dec_len) in enumerate(LENGTHS):
        encoder = tokenizer(texts[2 * i], truncation=True, max_length=enc_len)["input_ids"]
        target = tokenizer(texts[2 * i + 1])["input_ids"]
        decoder = [decoder_start, *target[: dec_len - 1]]
        assert len(encoder) == enc_len and len(decoder) == dec_len, (len(encoder), len(decoder))
        pairs.append((torch.tensor(encoder), torch.tensor(decoder)))
    return pairs


def _packed(sequences: list[torch.Tensor], offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(len(s)) + offset for s in sequences])
    return ids, positions


def _context(model, decoder_lens, encoder_lens) -> ForwardContext:
    """KV-free: causal decoder self-attention, bidirectional encoder, cross by the packed encoder lengths."""
    backend = NaiveBackend()
    decoder = build_common_metadata(np.array(decoder_lens), is_causal=True)
    encoder = build_common_metadata(np.array(encoder_lens), is_causal=False)
    cross = build_cross_metadata(
        np.array(decoder_lens), np.array(encoder_lens), decoder.cu_seqlens_q, encoder.cu_seqlens_q
    )
    return forward_context_for(
        model,
        backend,
        backend.build_metadata(decoder),
        encoder_metadata=backend.build_metadata(encoder),
        cross_metadata=backend.build_metadata(cross),
    )


def _run(model, pairs):
    """(decoder hidden [num_decoder_tokens, d], encoder output [num_encoder_tokens, d]) of one packed pass."""
    offset = model.position_offset
    encoder_ids, encoder_positions = _packed([e for e, _ in pairs], offset)
    decoder_ids, decoder_positions = _packed([d for _, d in pairs], offset)
    context = _context(model, [len(d) for _, d in pairs], [len(e) for e, _ in pairs])
    with torch.inference_mode(), set_forward_context(context):
        hidden = model(
            decoder_ids, decoder_positions, encoder_input_ids=encoder_ids, encoder_positions=encoder_positions
        )
        encoded = model.encode(encoder_ids, encoder_positions)
    return hidden, encoded


def _split(rows: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(rows.split(lengths))


def _reference(model_dir, model_class_name: str = "AutoModelForSeq2SeqLM"):
    import transformers

    return getattr(transformers, model_class_name).from_pretrained(str(model_dir), attn_implementation="eager").eval()


def _pooling(lengths: list[int]) -> PoolingInputs:
    ends = torch.tensor(np.cumsum(lengths), dtype=torch.int64)
    starts = ends - torch.tensor(lengths)
    return PoolingInputs(
        first_index=starts,
        last_index=ends - 1,
        token_index=None,
        token_seq=torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)),
        token_count=torch.tensor(lengths, dtype=torch.float32),
    )


@pytest.mark.parametrize("kind", list(SEQ2SEQ))
def test_decoder_logits_and_encoder_match_transformers(kind, model_root, texts):
    builder, options = SEQ2SEQ[kind]
    model_dir = builder(model_root, **options)
    model, hf_config, files, entry = _load_ours(model_dir)
    assert entry.is_encoder_decoder and model.kind is ModelKind.ENCODER_DECODER
    assert isinstance(model, BartModel if "bart" in kind else T5Model)
    pairs = _token_batches(model_dir, texts, model.decoder_start_token_id)
    hidden, encoded = _run(model, pairs)
    logits = build_lm_head(registry.lookup(hf_config.model_type), hf_config, files, CPU, torch.float32)(hidden)

    reference = _reference(model_dir)
    ours_logits = _split(logits, [len(d) for _, d in pairs])
    ours_encoded = _split(encoded, [len(e) for e, _ in pairs])
    with torch.inference_mode():
        for (encoder, decoder), got_logits, got_encoded in zip(pairs, ours_logits, ours_encoded, strict=True):
            out = reference(input_ids=encoder[None], decoder_input_ids=decoder[None])
            expected_encoded = out.encoder_last_hidden_state[0]
            torch.testing.assert_close(got_encoded, expected_encoded, atol=ATOL, rtol=0)
            torch.testing.assert_close(got_logits, out.logits[0], atol=ATOL, rtol=0)
    # The random weights separate inputs: a mistake would not hide behind near-constant outputs.
    assert (ours_logits[1][0] - ours_logits[3][0]).abs().max() > 0.5


def test_t5_scaling_rule_follows_the_config(model_root):
    """The tied-head scaling of T5 v1.0 is on, v1.1 (tie_word_embeddings false) and mT5 off."""
    from embedserv.models.families.t5 import output_scale

    tied = read_hf_config(builders.build_tiny_t5(model_root, variant="v1.0", tied=True))
    untied = read_hf_config(builders.build_tiny_t5(model_root, variant="v1.1", tied=False))
    mt5 = read_hf_config(builders.build_tiny_t5(model_root, variant="v1.1", tied=True, mt5=True))
    assert output_scale(tied) == pytest.approx(64**-0.5)
    assert output_scale(untied) == 1.0
    assert output_scale(mt5) == 1.0


def _encoder_only_check(model, reference, model_dir, texts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sequences = [
        torch.tensor(tokenizer(t, truncation=True, max_length=n)["input_ids"])
        for t, n in zip(texts[:4], (5, 48, 1, 23), strict=True)
    ]
    ids, positions = _packed(sequences, model.position_offset)
    lengths = [len(s) for s in sequences]
    backend = NaiveBackend()
    metadata = backend.build_metadata(build_common_metadata(np.array(lengths), is_causal=False))
    context = forward_context_for(model, backend, metadata)
    with torch.inference_mode(), set_forward_context(context):
        hidden = model(ids, positions)
        for sequence, got in zip(sequences, _split(hidden, lengths), strict=True):
            expected = reference(input_ids=sequence[None]).last_hidden_state[0]
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_sentence_t5_encoder_matches_transformers(model_root, texts):
    model_dir = builders.build_tiny_sentence_t5(model_root)
    model, _, _, entry = _load_ours(model_dir, sentence_transformers=True)
    assert isinstance(model, T5EncoderModel) and entry.is_encoder and not entry.is_encoder_decoder
    assert all(layer.self_attn.attn.kind == "decoder" for layer in model.encoder.layers)
    _encoder_only_check(model, _reference(model_dir, "T5EncoderModel"), model_dir, texts)


def test_t5_encoder_model_from_a_full_checkpoint(model_root, texts):
    """T5EncoderModel over a T5ForConditionalGeneration checkpoint: the decoder and LM head are skipped."""
    model_dir = builders.build_tiny_t5(model_root, variant="v1.1", tied=False)
    model, _, _, _ = _load_ours(model_dir, architecture="T5EncoderModel")
    assert isinstance(model, T5EncoderModel)
    _encoder_only_check(model, _reference(model_dir, "T5EncoderModel"), model_dir, texts)


def test_bart_sequence_classification_matches_transformers(model_root, texts):
    from transformers.models.bart.modeling_bart import shift_tokens_right

    model_dir = builders.build_tiny_bart_nli(model_root)
    model, hf_config, files, _ = _load_ours(model_dir)
    bart = registry.lookup("bart")
    assert hf_config.architectures[0] == "BartForSequenceClassification"
    head = build_classifier_head(bart, hf_config, hf_config.num_labels, files)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    inputs = [
        torch.tensor(tokenizer(a, b, truncation=True, max_length=n)["input_ids"])
        for a, b, n in zip(texts[0:8:2], texts[1:8:2], (6, 40, 17, 90), strict=True)
    ]
    pairs = [
        (ids, shift_tokens_right(ids[None], hf_config.pad_token_id, hf_config.decoder_start_token_id)[0])
        for ids in inputs
    ]
    hidden, _ = _run(model, pairs)
    got = head(hidden, _pooling([len(d) for _, d in pairs]))

    reference = _reference(model_dir, "AutoModelForSequenceClassification")
    with torch.inference_mode():
        expected = torch.cat([reference(input_ids=ids[None]).logits for ids in inputs])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert got.shape == (len(inputs), 3)


def test_monot5_head_matches_transformers(model_root, texts):
    model_dir = builders.build_tiny_monot5(model_root)
    true_id, false_id = builders.t5_true_false_ids(model_dir)
    model, hf_config, files, _ = _load_ours(model_dir)
    head = build_seq2seq_yes_no_head(registry.lookup(hf_config.model_type), hf_config, files, true_id, false_id)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [f"Query: {q[:40]} Document: {d[:300]} Relevant:" for q, d in zip(texts[:4], texts[4:8], strict=True)]
    start = torch.tensor([hf_config.decoder_start_token_id])
    pairs = [(torch.tensor(tokenizer(p)["input_ids"]), start) for p in prompts]
    hidden, _ = _run(model, pairs)
    got = head(hidden, _pooling([1] * len(pairs)))[:, 0]

    reference = _reference(model_dir)
    with torch.inference_mode():
        expected = []
        for encoder, decoder in pairs:
            logits = reference(input_ids=encoder[None], decoder_input_ids=decoder[None]).logits[0, 0]
            expected.append(logits[true_id] - logits[false_id])
    torch.testing.assert_close(got, torch.stack(expected), atol=ATOL, rtol=0)


def test_registry_lookup():
    assert registry.lookup("t5").model_class is T5Model
    assert registry.lookup("mt5", "MT5ForConditionalGeneration").is_encoder_decoder
    assert registry.lookup("t5", "T5EncoderModel").model_class is T5EncoderModel
    assert registry.lookup("t5", "T5ForConditionalGeneration", sentence_transformers=True).model_class is T5EncoderModel
    assert registry.lookup("bart", "BartForSequenceClassification").model_class is BartModel
    assert registry.lookup("mbart").is_encoder_decoder
    assert not registry.lookup("bert").is_encoder_decoder
    assert registry.lookup("bart", sentence_transformers=True).model_class is BartModel


def test_attention_layer_indices_are_unique(model_root):
    """The runner keys KV caches by layer index: decoder self 0..D-1, cross D..2D-1, encoder after."""
    from embedserv.attention.layer import Attention

    for model_dir in (builders.build_tiny_t5(model_root), builders.build_tiny_bart(model_root)):
        model, _, _, _ = _load_ours(model_dir)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        by_kind = {
            kind: sorted(a.layer_index for a in layers if a.kind == kind) for kind in ("decoder", "cross", "encoder")
        }
        assert by_kind == {"decoder": [0, 1], "cross": [2, 3], "encoder": [4, 5]}
        assert all(a.kv_group == (1 if a.kind == "cross" else 0) for a in layers)


def _paged(lens_q, lens_k, tables, block_size, cross=False):
    """Paged metadata writing nothing (steps that write keys replace slot_mapping): queries are each
    sequence's last lens_q tokens, keys its first lens_k (cross: every encoder key in the cross table)."""
    from embedserv.attention.metadata import build_paged_metadata, cumulative_offsets

    lens_q, lens_k = np.array(lens_q), np.array(lens_k)
    table = torch.tensor(tables, dtype=torch.int32)
    return build_paged_metadata(
        lens_q,
        lens_k,
        torch.from_numpy(cumulative_offsets(lens_q)),
        torch.from_numpy(cumulative_offsets(lens_k)),
        torch.zeros(0, dtype=torch.int64),
        table,
        torch.from_numpy(lens_k),
        block_size,
        cross=cross,
    )


def _slots(tables, block_size, ranges) -> torch.Tensor:
    """Cache slots of positions [start, end) of each sequence, packed."""
    slots = [
        tables[s][p // block_size] * block_size + p % block_size for s, (a, b) in enumerate(ranges) for p in range(a, b)
    ]
    return torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize("kind", ["t5-v1.1-untied", "bart"])
def test_paged_generation_steps_match_teacher_forcing(kind, model_root, texts):
    """A prefill step (encoder, decoder prompt, cross K/V written to the cache) then two decode steps in
    which cross layers get no K/V and read the cross cache: logits as transformers' teacher-forced pass."""
    import dataclasses

    builder, options = SEQ2SEQ[kind]
    model_dir = builder(model_root, **options)
    model, hf_config, files, _ = _load_ours(model_dir)
    head = build_lm_head(registry.lookup(hf_config.model_type), hf_config, files, CPU, torch.float32)
    full = _token_batches(model_dir, texts, model.decoder_start_token_id)[1:3]  # decoders of 7 and 26 tokens
    prompt_lens, steps, block_size = [5, 1], 2, 4
    encoder_lens = [len(e) for e, _ in full]
    num_decoder = len(model.decoder.layers)
    heads, size = model.decoder.layers[0].self_attn.attn.num_heads, model.decoder.layers[0].self_attn.attn.head_size
    self_tables = [[0, 1, 2], [3, 4, 5]]
    cross_tables = [[i for i in range(s * 16, s * 16 + 16)] for s in range(2)]
    caches = [torch.zeros(2, 32, block_size, heads, size) for _ in range(2 * num_decoder)]
    backend = NaiveBackend()
    offset = model.position_offset
    got = []
    for step in range(steps + 1):
        ranges = [(0, n) if step == 0 else (n + step - 1, n + step) for n in prompt_lens]
        decoder_ids = torch.cat([d[a:b] for (_, d), (a, b) in zip(full, ranges, strict=True)])
        positions = torch.cat([torch.arange(a, b) for a, b in ranges]) + offset
        lens_q = [b - a for a, b in ranges]
        lens_k = [b for _, b in ranges]
        self_meta = dataclasses.replace(
            _paged(lens_q, lens_k, self_tables, block_size), slot_mapping=_slots(self_tables, block_size, ranges)
        )
        cross_meta = _paged(lens_q, encoder_lens, cross_tables, block_size, cross=True)
        kwargs = {}
        encoder_meta = None
        if step == 0:
            encoder_slots = _slots(cross_tables, block_size, [(0, n) for n in encoder_lens])
            cross_meta = dataclasses.replace(cross_meta, slot_mapping=encoder_slots)
            encoder_ids, encoder_positions = _packed([e for e, _ in full], offset)
            kwargs = dict(encoder_input_ids=encoder_ids, encoder_positions=encoder_positions)
            encoder_meta = backend.build_metadata(build_common_metadata(np.array(encoder_lens), is_causal=False))
        context = forward_context_for(
            model,
            backend,
            (backend.build_metadata(self_meta), backend.build_metadata(cross_meta)),
            kv_caches=caches,
            encoder_metadata=encoder_meta,
        )
        with torch.inference_mode(), set_forward_context(context):
            logits = head(model(decoder_ids, positions, **kwargs))
        got.append(_split(logits, lens_q))

    reference = _reference(model_dir)
    with torch.inference_mode():
        for s, (encoder, decoder) in enumerate(full):
            length = prompt_lens[s] + steps
            expected = reference(input_ids=encoder[None], decoder_input_ids=decoder[None, :length]).logits[0]
            ours = torch.cat([got[step][s] for step in range(steps + 1)])
            torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
