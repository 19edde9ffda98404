"""Truncated inputs tokenized from a prefix: the same ids, without tokenizing text that truncation drops.

A text that will be cut to `room` tokens from the right needs only as much of itself as makes `room` tokens. Cut
where a run of whitespace starts, the text before the cut tokenizes exactly as it does inside the whole text, as
long as the tokenizer's normalizer maps characters one by one and its pre-tokenizer splits words at whitespace:
every word before the cut is whole, and no token spans whitespace. So if the prefix gives at least `room` tokens,
its first `room` are the whole text's first `room`; if it gives fewer, the whole text is tokenized after all. On the
benchmark corpus, a fifth of the texts are past 128 tokens, and they hold most of its characters
(docs/performance-history.md, issue 34). Left truncation tokenizes the whole text. Tokenizers whose pieces may not
be cut this way (SentencePiece without whitespace splitting, a charsmap normalizer, added tokens with spaces in them)
always tokenize the whole text.
"""

from __future__ import annotations

import json

import tokenizers

# A prefix of this many characters per token of room. English runs about 4 to 5 characters a token; on the
# benchmark corpus (host-tiny, 126 tokens of room) 6 needed no second pass and cut tokenizing from 180 to
# 86 us a text (10: 114 us; 5: 40 second passes in 3,000, 92 us; 4: 374, 151 us).
CHARS_PER_TOKEN = 6
_SAFE_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents"}
_SAFE_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits"}


def _all_safe(node: dict | None, safe: set[str], check=lambda node: True) -> bool:
    if node is None:
        return True
    if node.get("type") == "Sequence":
        parts = node.get("normalizers") or node.get("pretokenizers") or []
        return all(_all_safe(part, safe, check) for part in parts)
    return node.get("type") in safe and check(node)


def _safe_pre_tokenizer(node: dict) -> bool:
    kind = node.get("type")
    if kind == "ByteLevel":
        return node.get("use_regex", True)
    if kind == "Metaspace":
        return node.get("split", True)
    return True


def cuts_safely(backend: tokenizers.Tokenizer) -> bool:
    """Whether a cut where whitespace starts leaves every token before it as it is (see the module docstring)."""
    spec = json.loads(backend.to_str())
    if any(any(c.isspace() for c in token["content"]) for token in spec.get("added_tokens", [])):
        return False
    pre_tokenizers = _SAFE_PRE_TOKENIZERS | {"ByteLevel", "Metaspace"}
    return (
        spec.get("pre_tokenizer") is not None
        and _all_safe(spec.get("normalizer"), _SAFE_NORMALIZERS)
        and _all_safe(spec["pre_tokenizer"], pre_tokenizers, _safe_pre_tokenizer)
    )


def prefix(text: str, max_chars: int) -> str | None:
    """`text` cut where the last run of whitespace before `max_chars` starts; None when it is no longer than
    that or has no such whitespace."""
    if len(text) <= max_chars:
        return None
    end = max_chars
    while end > 0 and not text[end].isspace():
        end -= 1
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return text[:end] if end > 0 else None


def encode_for_room(backend: tokenizers.Tokenizer, texts: list[str], room: int) -> list[tokenizers.Encoding]:
    """Each text's encoding (no special tokens) with at least its first `room` tokens exactly as the whole
    text's; the caller truncates to `room` from the right."""
    cuts = [prefix(text, room * CHARS_PER_TOKEN) for text in texts]
    encodings = backend.encode_batch(
        [cut or text for cut, text in zip(cuts, texts, strict=True)], add_special_tokens=False
    )
    short = [
        i
        for i, (cut, encoding) in enumerate(zip(cuts, encodings, strict=True))
        if cut is not None and len(encoding.ids) < room
    ]
    if short:
        for i, encoding in zip(
            short, backend.encode_batch([texts[i] for i in short], add_special_tokens=False), strict=True
        ):
            encodings[i] = encoding
    return encodings
