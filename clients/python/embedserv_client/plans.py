"""One client call as a plan: the server-sized requests to send and how to merge their replies.

The sync and async clients differ only in how they send a plan's requests (threads or tasks), so
building requests and merging replies lives here, once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from embedserv_client.types import (
    OUTPUTS,
    Classification,
    EmbedOutputs,
    RerankResult,
    SparseEmbedding,
    Token,
    multi_vector,
)
from embedserv_client.v1 import embedserv_pb2 as pb

_DIRECTIONS = {"right": pb.TRUNCATION_DIRECTION_RIGHT, "left": pb.TRUNCATION_DIRECTION_LEFT}
# encoding name -> (the wire encoding, the dtype of Embedding.raw). int8 / uint8 rank under raw integer dot
# products (EmbedResponse.encoding_scale decodes them); the per-dimension ones are sentence-transformers'
# buckets; binary / ubinary are packed bits, 8 dimensions a byte (most significant bit first), as int8 (each
# byte minus 128) / uint8.
ENCODINGS = {
    "float32": (pb.ENCODING_BYTES, "<f4"),
    "float16": (pb.ENCODING_FLOAT16, "<f2"),
    "int8": (pb.ENCODING_INT8, "i1"),
    "uint8": (pb.ENCODING_UINT8, "u1"),
    "int8_per_dimension": (pb.ENCODING_INT8_PER_DIMENSION, "i1"),
    "uint8_per_dimension": (pb.ENCODING_UINT8_PER_DIMENSION, "u1"),
    "binary": (pb.ENCODING_BINARY, "i1"),
    "ubinary": (pb.ENCODING_UBINARY, "u1"),
}
_RAW_DTYPES: dict[int, np.dtype] = {wire: np.dtype(dtype) for wire, dtype in ENCODINGS.values()}
T = TypeVar("T")
_CHUNKING = {"embed": ("mean", pb.CHUNKING_MEAN), "rerank": ("max", pb.CHUNKING_MAX)}


@dataclass(frozen=True)
class Plan:
    method: str  # the Inference stub's method name
    requests: list[Any]
    merge: Callable[[list[Any]], Any]  # replies in request order -> the call's result
    inputs_per_request: int  # the most inputs one request carries (the server's admission counts inputs)


def chunks(items: Sequence[T], size: int) -> list[list[T]]:
    """`items` cut into lists of at most `size`; one empty list for no items (the server says why)."""
    if size < 1:
        raise ValueError(f"batch size must be at least 1, not {size}")
    return [list(items[i : i + size]) for i in range(0, len(items), size)] or [[]]


def as_list(texts: str | Sequence[str], what: str) -> tuple[list[str], bool]:
    """The texts as a list, and whether the caller gave one string (and wants one result back)."""
    if isinstance(texts, str):
        return [texts], True
    if isinstance(texts, bytes):  # type: ignore[unreachable]  # callers without a type checker pass bytes
        raise TypeError(f"{what} must be str or a sequence of str, not bytes; decode it first")
    if not isinstance(texts, Iterable):
        raise TypeError(f"{what} must be str or a sequence of str, not {type(texts).__name__}")
    return strings(list(texts), what), False


def strings(items: list, what: str) -> list[str]:
    """`items` if each is a str. Checked here, where the caller's names are known: protobuf would refuse a
    non-str deep inside the request with a bare TypeError that names neither the argument nor the item."""
    for index, item in enumerate(items):
        if not isinstance(item, str):
            shown = repr(item) if len(repr(item)) <= 40 else repr(item)[:37] + "..."
            raise TypeError(f"{what}[{index}] must be str, not {type(item).__name__} ({shown})")
    return items


class StreamRequests:
    """embed_stream's requests, checked as gRPC reads them. It reads them in its own thread (or task) and makes an
    error there UNKNOWN "Exception iterating requests!", so the first one is kept here for the caller instead."""

    def __init__(self, fields: dict) -> None:
        self.fields = fields
        self.error: TypeError | None = None

    def request(self, index: int, batch: Sequence[str]) -> pb.EmbedRequest:
        try:
            if isinstance(batch, (str, bytes)):  # list() would split it into characters
                raise TypeError(f"batches[{index}] must be a sequence of str, not {type(batch).__name__}")
            return pb.EmbedRequest(inputs=strings(list(batch), f"batches[{index}]"), **self.fields)
        except TypeError as err:
            self.error = err
            raise


def string(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be str, not {type(value).__name__}")
    return value


def direction(value: str) -> int:
    if value not in _DIRECTIONS:
        raise ValueError(f"truncation_direction must be 'right' or 'left', not {value!r}")
    return _DIRECTIONS[value]


def encoding(name: str) -> int:
    if name not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, not {name!r}")
    return ENCODINGS[name][0]


def chunking(value: str | None, call: str) -> int:
    """None / "none", or the call's one mode: "mean" for embed, "max" for rerank."""
    mode, wire = _CHUNKING[call]
    if value in (None, "none"):
        return pb.CHUNKING_NONE
    if value != mode:
        raise ValueError(f"{call} chunking must be {mode!r} (or None), not {value!r}")
    return wire


def outputs(names: Sequence[str] | str) -> list[int]:
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown or not names:
        raise ValueError(f"outputs must name some of {', '.join(OUTPUTS)}, not {names!r}")
    return [OUTPUTS[n] for n in names]


def embedding_matrix(replies: list[pb.EmbedResponse], wire: int = pb.ENCODING_BYTES) -> np.ndarray:
    """[n, d] from replies in the raw encoding `wire`: float32, float16, int8 or uint8 (packed bits: d / 8)."""
    dtype = _RAW_DTYPES[wire]
    rows = [np.frombuffer(e.raw, dtype=dtype) for reply in replies for e in reply.embeddings]
    if not rows:
        return np.zeros((0, 0), dtype=dtype.newbyteorder("="))
    return np.stack(rows).astype(dtype.newbyteorder("="), copy=False)


def embed_plan(texts: list[str], size: int, single: bool, **fields) -> Plan:
    """Without `outputs` in fields, the call's result is the dense matrix; with them, an EmbedOutputs."""
    requests = [pb.EmbedRequest(inputs=part, **fields) for part in chunks(texts, size)]
    return Plan("Embed", requests, embed_merge(fields, single), min(size, len(texts)))


def embed_merge(fields: dict, single: bool) -> Callable[[list[pb.EmbedResponse]], np.ndarray | EmbedOutputs]:
    """Embed replies in request order -> the dense matrix, or an EmbedOutputs when `fields` name outputs."""
    wire, wanted = fields["encoding"], fields.get("outputs")

    def merge(replies: list[pb.EmbedResponse]) -> np.ndarray | EmbedOutputs:
        matrix = embedding_matrix(replies, wire)
        if not wanted:
            return matrix[0] if single else matrix
        sparse = [SparseEmbedding.from_proto(e) for reply in replies for e in reply.sparse_embeddings]
        vectors = [multi_vector(m) for reply in replies for m in reply.multi_vectors]
        pick = (lambda items: items[0]) if single else (lambda items: items)
        return EmbedOutputs(
            dense=pick(matrix) if pb.OUTPUT_DENSE in wanted else None,
            sparse=pick(sparse) if pb.OUTPUT_SPARSE in wanted else None,
            multi_vector=pick(vectors) if pb.OUTPUT_MULTI_VECTOR in wanted else None,
            # One scale per model and setting: every part of the call carries the same.
            encoding_scale=replies[0].encoding_scale if replies else 0.0,
        )

    return merge


def embed_fields(
    model: str,
    normalize: bool | None,
    truncate: bool | None,
    truncation_direction: str,
    dimensions: int | None,
    prompt_name: str | None,
    encoding_name: str = "float32",
    output_names: Sequence[str] | str | None = None,
    chunking_mode: str | None = None,
    sparse_top_k: int | None = None,
    task: str | None = None,
    bypass_cache: bool = False,
) -> dict:
    fields: dict[str, Any] = dict(
        model=model,
        truncate=truncate,
        truncation_direction=direction(truncation_direction),
        encoding=encoding(encoding_name),
        chunking=chunking(chunking_mode, "embed"),
    )
    if normalize is not None:
        fields["normalize"] = normalize
    if dimensions is not None:
        fields["dimensions"] = dimensions
    if prompt_name:
        fields["prompt_name"] = prompt_name
    if output_names is not None:
        fields["outputs"] = outputs(output_names)
    if sparse_top_k is not None:
        fields["sparse_top_k"] = sparse_top_k
    if task:
        fields["task"] = task
    if bypass_cache:
        fields["bypass_cache"] = True
    return fields


def embed_sparse_plan(texts: list[str], size: int, single: bool, **fields) -> Plan:
    requests = [pb.EmbedSparseRequest(inputs=part, **fields) for part in chunks(texts, size)]

    def merge(replies: list[pb.EmbedSparseResponse]) -> SparseEmbedding | list[SparseEmbedding]:
        results = [SparseEmbedding.from_proto(e) for reply in replies for e in reply.embeddings]
        return results[0] if single else results

    return Plan("EmbedSparse", requests, merge, min(size, len(texts)))


def embed_multi_vector_plan(texts: list[str], size: int, single: bool, **fields) -> Plan:
    requests = [pb.EmbedMultiVectorRequest(inputs=part, **fields) for part in chunks(texts, size)]

    def merge(replies: list[pb.EmbedMultiVectorResponse]) -> np.ndarray | list[np.ndarray]:
        results = [multi_vector(m) for reply in replies for m in reply.embeddings]
        return results[0] if single else results

    return Plan("EmbedMultiVector", requests, merge, min(size, len(texts)))


def rerank_plan(
    query: str | pb.InputItem, documents: list, size: int, top_n: int | None, field: str = "documents", **fields
) -> Plan:
    """Each part scores its documents (texts, or images when `field` is document_images or document_items) against
    the same query (a text, or an InputItem: query_item); scores do not depend on the other documents, so the
    parts merge by score and the cut to `top_n` happens after the merge."""
    parts = chunks(documents, size)
    asked = _named("query_item" if isinstance(query, pb.InputItem) else "query", query)
    requests = [pb.RerankRequest(**asked, **_named(field, part), **fields) for part in parts]
    if len(requests) == 1 and top_n is not None:
        requests[0].top_n = top_n
    offsets = np.cumsum([0] + [len(part) for part in parts[:-1]]).tolist()

    def merge(replies: list[pb.RerankResponse]) -> list[RerankResult]:
        results = [
            RerankResult(offset + r.index, r.score, r.document if fields.get("return_documents") else None)
            for offset, reply in zip(offsets, replies, strict=True)
            for r in reply.results
        ]
        results.sort(key=lambda r: (-r.score, r.index))
        return results if top_n is None else results[:top_n]

    return Plan("Rerank", requests, merge, min(size, len(documents)))


def classify_plan(texts: list[str], size: int, single: bool, **fields) -> Plan:
    """With candidate labels every (text, label) pair is one of the server's inputs, so each request
    carries at most size // labels texts (at least one; a text with more labels than that is the server's
    to refuse). Scores do not depend on the other texts, so the parts simply concatenate."""
    per_text = max(len(fields.get("candidate_labels") or ()), 1)
    part_size = max(size // per_text, 1)
    requests = [pb.ClassifyRequest(inputs=part, **fields) for part in chunks(texts, part_size)]

    def merge(replies: list[pb.ClassifyResponse]) -> Classification | list[Classification]:
        results = [Classification.from_proto(c) for reply in replies for c in reply.classifications]
        return results[0] if single else results

    return Plan("Classify", requests, merge, min(part_size, len(texts)) * per_text)


def tokenize_plan(texts: list[str], size: int, single: bool, **fields) -> Plan:
    requests = [pb.TokenizeRequest(inputs=part, **fields) for part in chunks(texts, size)]

    def merge(replies: list[pb.TokenizeResponse]) -> list[Token] | list[list[Token]]:
        results = [
            [Token(t.id, t.text, t.start, t.end, t.special) for t in tokenized.tokens]
            for reply in replies
            for tokenized in reply.inputs
        ]
        return results[0] if single else results

    return Plan("Tokenize", requests, merge, min(size, len(texts)))


def generate_request(
    prompt: str,
    model: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: Sequence[str] | str | None,
    ignore_eos: bool,
    decoder_prompt: str = "",
) -> pb.GenerateRequest:
    if isinstance(stop, str):
        stop = [stop]
    request = pb.GenerateRequest(
        model=model,
        prompt=string(prompt, "prompt"),
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=strings(list(stop or ()), "stop"),
        ignore_eos=ignore_eos,
        decoder_prompt=decoder_prompt,
    )
    if seed is not None:
        request.seed = seed
    return request


def _named(field: str, value: object) -> dict[str, Any]:
    """`{field: value}`, for a message field chosen at run time."""
    return {field: value}
