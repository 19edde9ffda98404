"""Rerank's and Classify's inputs of two texts: a query with each document (cross-encoders, cut only in the
document), a yes/no reranker's prompt (decoder and seq2seq templates), and a premise with each hypothesis
(zero-shot classification), tokenized as the reference libraries do with the model's TextTokenizer."""

from __future__ import annotations

import tokenizers

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.tokenizer import TextTokenizer, split_windows
from embedserv.errors import InvalidInput
from embedserv.models.loading.tasks import Seq2SeqYesNoTemplate, YesNoTemplate
from embedserv.types import TruncationDirection


def encode_seq2seq_template(
    tokenizer: TextTokenizer, template: Seq2SeqYesNoTemplate, query: str, documents: list[str], truncate: bool
) -> list[InputSequence]:
    """A seq2seq reranker's encoder input per document (monoT5: `Query: q Document: d Relevant:` with
    the model's special tokens), tokenized as one text. When it is too long, the document is cut (never
    the query or the template): then the text's three parts are tokenized apart, which word-splitting
    tokenizers (T5's Metaspace) tokenize the same way at those space-separated joins."""
    head = f"{template.before_query}{query}{template.before_document}"
    texts = [f"{head}{d}{template.after_document}" for d in documents]
    encodings = tokenizer.backend.encode_batch(texts, add_special_tokens=False)
    out = []
    for index, encoding in enumerate(encodings):
        if len(encoding.ids) + tokenizer.num_special > tokenizer.max_input_tokens:
            encoding = _cut_document(tokenizer, head, documents[index], template.after_document, truncate, index)
        out.append(InputSequence(ids=tokenizer.backend.post_process(encoding, None, True).ids))
    return out


def _cut_document(tokenizer: TextTokenizer, head: str, document: str, tail: str, truncate: bool, index: int):
    head_e, tail_e = (tokenizer.backend.encode(t, add_special_tokens=False) for t in (head, tail))
    room = tokenizer.max_input_tokens - tokenizer.num_special - len(head_e.ids) - len(tail_e.ids)
    if room < 1:
        raise InvalidInput(
            f"the query and the reranking prompt take {len(head_e.ids) + len(tail_e.ids)} tokens, which leaves "
            f"no room for a document within the model's limit of {tokenizer.max_input_tokens}; shorten the query"
        )
    document_e = tokenizer.backend.encode(document, add_special_tokens=False)
    if not truncate:
        total = len(head_e.ids) + len(document_e.ids) + len(tail_e.ids) + tokenizer.num_special
        raise tokenizer.too_long(f"the prompt for document {index}", total, tokenizer.max_input_tokens)
    document_e.truncate(room, direction="right")
    return tokenizers.Encoding.merge([head_e, document_e, tail_e])


def encode_pairs(tokenizer: TextTokenizer, query: str, documents: list[str], truncate: bool) -> list[InputSequence]:
    """Query and document in one sequence each (cross-encoders); only documents are ever cut."""
    query_encoding, room = _pair_room(tokenizer, query)
    encodings = tokenizer.backend.encode_batch([tokenizer.prepare(d) for d in documents], add_special_tokens=False)
    out = []
    for index, document in enumerate(encodings):
        if len(document.ids) > room:
            if not truncate:
                total = len(document.ids) + len(query_encoding.ids) + tokenizer.num_pair_special
                raise tokenizer.too_long(f"the query with document {index}", total, tokenizer.max_input_tokens)
            document.truncate(room, direction="right")
        out.append(_pair(tokenizer, query_encoding, document))
    return out


def encode_pair_windows(tokenizer: TextTokenizer, query: str, documents: list[str]) -> list[list[InputSequence]]:
    """Chunked Rerank's cross-encoder inputs: per document, the query paired with each window of the
    document that fits beside it (no overlap). A document that fits is one pair, as encode_pairs makes it."""
    query_encoding, room = _pair_room(tokenizer, query)
    encodings = tokenizer.backend.encode_batch([tokenizer.prepare(d) for d in documents], add_special_tokens=False)
    return [[_pair(tokenizer, query_encoding, window) for window in split_windows(d, room)] for d in encodings]


def _pair_room(tokenizer: TextTokenizer, query: str) -> tuple[tokenizers.Encoding, int]:
    """The query's tokens and the room they leave for a document; refused when they leave none."""
    query_encoding = tokenizer.backend.encode(tokenizer.prepare(query), add_special_tokens=False)
    room = tokenizer.max_input_tokens - tokenizer.num_pair_special - len(query_encoding.ids)
    if room < 1:
        raise InvalidInput(
            f"the query has {len(query_encoding.ids)} tokens, which leaves no room for a document within the "
            f"model's limit of {tokenizer.max_input_tokens} tokens; shorten the query"
        )
    return query_encoding, room


def _pair(tokenizer: TextTokenizer, query: tokenizers.Encoding, document: tokenizers.Encoding) -> InputSequence:
    pair = tokenizer.backend.post_process(query, document, True)
    types = list(pair.type_ids) if tokenizer.feeds_token_types else None
    return InputSequence(ids=pair.ids, token_type_ids=types)


def encode_premise_pairs(
    tokenizer: TextTokenizer, premises: list[str], hypotheses: list[str], truncate: bool, direction: TruncationDirection
) -> list[InputSequence]:
    """Each premise with each hypothesis as one pair sequence (input-major), as the pipeline's tokenizer
    call makes them: special tokens of a pair and its segment ids; with `truncate`, only the premise is
    cut ("only_first"), from the `direction` side; the hypothesis never is.

    (encode_pairs cuts the second text, the document, instead.)
    """
    backend, limit = tokenizer.backend, tokenizer.max_input_tokens
    num_special = tokenizer.num_pair_special
    hypothesis_encodings = backend.encode_batch([tokenizer.prepare(h) for h in hypotheses], add_special_tokens=False)
    for label, hypothesis in enumerate(hypothesis_encodings):
        if len(hypothesis.ids) + num_special >= limit:
            raise InvalidInput(
                f"the hypothesis of candidate_labels[{label}] has {len(hypothesis.ids)} tokens, which leaves no "
                f"room for an input within the model's limit of {limit} tokens; shorten the label or "
                "hypothesis_template"
            )
    prepared = [tokenizer.prepare(p) for p in premises]
    out = []
    for index, premise in enumerate(backend.encode_batch(prepared, add_special_tokens=False)):
        for label, hypothesis in enumerate(hypothesis_encodings):
            room = limit - num_special - len(hypothesis.ids)
            first = premise
            if len(premise.ids) > room:
                if not truncate:
                    total = len(premise.ids) + len(hypothesis.ids) + num_special
                    raise tokenizer.too_long(
                        f"input {index} with the hypothesis of candidate_labels[{label}]", total, limit
                    )
                # Truncation cuts an encoding in place, and each hypothesis leaves its own room.
                first = backend.encode(prepared[index], add_special_tokens=False)
                first.truncate(room, direction=str(direction))
            pair = backend.post_process(first, hypothesis, True)
            types = list(pair.type_ids) if tokenizer.feeds_token_types else None
            out.append(InputSequence(ids=pair.ids, token_type_ids=types))
    return out


def _template_ids(tokenizer: TextTokenizer, template: YesNoTemplate) -> tuple[list[int], list[int]]:
    """The template's prefix and suffix tokens, tokenized once per tokenizer."""
    if template not in tokenizer.template_cache:
        encode = tokenizer.backend.encode
        tokenizer.template_cache[template] = (
            encode(template.prefix, add_special_tokens=False).ids,
            encode(template.suffix, add_special_tokens=False).ids,
        )
    return tokenizer.template_cache[template]


def encode_templated(
    tokenizer: TextTokenizer,
    template: YesNoTemplate,
    instruction: str,
    query: str,
    documents: list[str],
    truncate: bool,
) -> list[InputSequence]:
    """A yes/no reranker's prompt per document, as its model card builds it: prefix, then
    instruction + query + document tokenized as one text (cut at the end of the document), then suffix."""
    prefix, suffix = _template_ids(tokenizer, template)
    room = tokenizer.max_input_tokens - len(prefix) - len(suffix) - tokenizer.num_special
    head = template.query_part(instruction, query)
    head_tokens = len(tokenizer.backend.encode(head, add_special_tokens=False).ids)
    if head_tokens >= room:
        raise InvalidInput(
            f"the instruction and query take {head_tokens} tokens of the {room} the model's limit of "
            f"{tokenizer.max_input_tokens} leaves beside its prompt template; shorten the query"
        )
    encodings = tokenizer.backend.encode_batch([head + d for d in documents], add_special_tokens=False)
    out = []
    for index, encoding in enumerate(encodings):
        if len(encoding.ids) > room:
            if not truncate:
                total = len(encoding.ids) + len(prefix) + len(suffix) + tokenizer.num_special
                raise tokenizer.too_long(f"the prompt for document {index}", total, tokenizer.max_input_tokens)
            encoding.truncate(room, direction="right")
        out.append(InputSequence(ids=prefix + tokenizer.backend.post_process(encoding, None, True).ids + suffix))
    return out
