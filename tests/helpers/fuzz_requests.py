"""Hypothesis strategies for the fuzz test of every RPC (tests/e2e/test_fuzz.py): random requests whose
fields are usually valid and now and then wild."""

from __future__ import annotations

from hypothesis import strategies as st

# The served names the fuzz server uses; the embedder comes first, so an empty model name means it.
EMBEDDER, CROSS, CLASSIFIER, GEN = "minilm", "tiny-ce", "tiny-cls", "tiny-llama"
SERVED = (EMBEDDER, CROSS, CLASSIFIER, GEN)
MAX_INPUT_CHARS = 300
MAX_CLIENT_BATCH = 8


def pb_module():
    from embedserv.v1 import embedserv_pb2 as pb

    return pb


# --- strategies ---------------------------------------------------------------------------------------------
# Each field is usually valid and now and then wild, so a good share of requests gets past validation into
# tokenization, batching and the model, where the less obvious failures live.

# Protobuf strings must be valid UTF-8, so no lone surrogates; everything else (NUL, controls, emoji) is fair.
CHARS = st.characters(blacklist_categories=("Cs",))
WORDS = ("hello", "world", "zip", "file", "the", "fox", "[CLS]", "[SEP]", "[PAD]", "[UNK]", "<s>", "</s>", "##ing")
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
# Float fields are float32 on the wire; st.floats(width=32) draws nan, +-inf, -0.0, subnormals and huge values.
FLOAT32 = st.floats(width=32)


@st.composite
def mostly(draw, usual: st.SearchStrategy, unusual: st.SearchStrategy, one_in: int = 8):
    """A draw from `unusual` one time in `one_in`, else from `usual` (shrinking leads back to `usual`)."""
    return draw(unusual if draw(st.integers(0, one_in - 1)) == one_in - 1 else usual)


short_texts = st.one_of(st.text(CHARS, max_size=40), st.lists(st.sampled_from(WORDS), max_size=30).map(" ".join))
nonempty_texts = st.one_of(
    st.text(CHARS, min_size=1, max_size=40), st.lists(st.sampled_from(WORDS), min_size=1, max_size=30).map(" ".join)
)
# Around the --max-input-chars limit, and past the 128/256-token windows of the encoders once tokenized.
long_texts = st.text(CHARS, min_size=MAX_INPUT_CHARS - 5, max_size=MAX_INPUT_CHARS + 60)
texts = mostly(short_texts, long_texts, one_in=12)
# 1..8 inputs; sometimes none, or more than --max-client-batch-size.
text_lists = mostly(st.lists(texts, min_size=1, max_size=MAX_CLIENT_BATCH), st.lists(texts, max_size=10))


def model_names(*preferred: str) -> st.SearchStrategy[str]:
    """Mostly models that can answer the RPC; else any served model, "" (the first one) or a random name."""
    others = st.one_of(st.sampled_from((*SERVED, "")), st.text(CHARS, max_size=20))
    return mostly(st.sampled_from(preferred), others, one_in=6)


def enum_values(*valid: int) -> st.SearchStrategy[int]:
    # proto3 enums are open: any int32 reaches the server.
    return mostly(st.sampled_from(valid), INT32)


def prompt_names() -> st.SearchStrategy[str]:
    """Mostly none; the served models define no prompts, so any name is one they do not know."""
    return mostly(st.just(""), st.one_of(st.sampled_from(("query", "document")), st.text(CHARS, max_size=10)))


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """None leaves the field unset."""
    return st.one_of(st.none(), strategy)


def message(cls, **fields: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries(fields).map(lambda drawn: cls(**{k: v for k, v in drawn.items() if v is not None}))


def embed_requests() -> st.SearchStrategy:
    pb = pb_module()
    return message(
        pb.EmbedRequest,
        model=model_names(EMBEDDER),
        inputs=text_lists,
        normalize=optional(st.booleans()),
        truncate=st.booleans(),
        truncation_direction=enum_values(0, 1),
        dimensions=optional(mostly(st.integers(1, 384), UINT32)),
        prompt_name=prompt_names(),
        encoding=enum_values(0, 1),
    )


def tokenize_requests() -> st.SearchStrategy:
    pb = pb_module()
    return message(
        pb.TokenizeRequest,
        model=model_names(*SERVED),
        inputs=text_lists,
        add_special_tokens=optional(st.booleans()),
        prompt_name=prompt_names(),
    )


def rerank_requests() -> st.SearchStrategy:
    pb = pb_module()
    return message(
        pb.RerankRequest,
        model=model_names(CROSS, EMBEDDER),
        query=mostly(nonempty_texts, texts),
        documents=text_lists,
        top_n=optional(mostly(st.integers(0, 10), UINT32)),
        return_documents=st.booleans(),
        raw_scores=st.booleans(),
        truncate=st.booleans(),
        instruction=mostly(st.just(""), texts),
    )


def classify_requests() -> st.SearchStrategy:
    pb = pb_module()
    return message(
        pb.ClassifyRequest,
        model=model_names(CLASSIFIER, CROSS),
        inputs=text_lists,
        truncate=st.booleans(),
        truncation_direction=enum_values(0, 1),
        raw_scores=st.booleans(),
    )


def generate_requests() -> st.SearchStrategy:
    pb = pb_module()
    return message(
        pb.GenerateRequest,
        model=model_names(GEN),
        prompt=mostly(nonempty_texts, texts),
        # Mostly short so generation stays fast; the huge ones are past any context and must be refused.
        max_tokens=mostly(st.integers(1, 40), st.sampled_from((0, 513, 100_000, 2**32 - 1))),
        temperature=mostly(st.floats(0, 2), FLOAT32),
        top_p=mostly(st.floats(0, 1), FLOAT32),
        top_k=mostly(st.integers(0, 50), UINT32),
        seed=optional(st.integers(0, 2**64 - 1)),
        stop=mostly(st.lists(st.text(CHARS, min_size=1, max_size=3), max_size=3), st.lists(texts, max_size=4)),
        ignore_eos=st.booleans(),
    )


def _unknown_field(number: int, value: int | bytes) -> bytes:
    """One field in protobuf wire format: a varint, or length-delimited bytes."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def list_models_requests() -> st.SearchStrategy:
    # ListModelsRequest has no fields; fields a newer client might send arrive as unknown fields.
    pb = pb_module()
    unknown = st.tuples(st.integers(1, 2**29 - 1), st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=20)))
    return st.lists(unknown, max_size=4).map(
        lambda fields: pb.ListModelsRequest.FromString(b"".join(_unknown_field(n, v) for n, v in fields))
    )
