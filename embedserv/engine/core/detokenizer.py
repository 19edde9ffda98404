"""Streaming text for generation: one new token id per step in, the text that is safe to send out.

The text streamed for a request is what `tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)`
shows after the prompt's own decoded text. Where the prompt's text is not a prefix of that (the prompt ends
inside a UTF-8 character, or the tokenizer's space cleanup joins the prompt's end to the first generated
word), the stream is the full text after the longest common prefix of the two.

Three stages, each O(a few tokens or characters) per step:
1. Token window: decode only the tokens since the last release plus those just before them (vLLM's
   prefix/read offsets), and hold a token back while its text ends in an incomplete character (U+FFFD).
2. Space cleanup, only for tokenizers that apply transformers' `clean_up_tokenization` ("do n't" ->
   "don't"): cleaned in chunks cut where no cleanup pattern can span the cut.
3. Stop strings: text that could still begin a stop string is held back; the text ends at the first
   character that completes a stop string, just before the earliest stop string it completes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache, partial

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first generated one, so it decodes in context (its leading space).
_INITIAL_CONTEXT_TOKENS = 6
# A UTF-8 character spans at most 4 byte tokens; text still incomplete after this many tokens holds
# invalid bytes that will never complete, so waiting longer would only grow the window.
_MAX_UNREAD_TOKENS = 8
# transformers' `clean_up_tokenization` replacements (each deletes spaces before the rest of its pattern).
_CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")
_CLEANUP_REACH = max(len(pattern) for pattern in _CLEANUP_PATTERNS) - 1
# Raw text held by the cleanup stage before it cuts anyway (only reached by text like " ' ' ' ' ...").
_MAX_CLEANUP_PENDING = 64


def _common_prefix_len(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    index = 0
    while a[index] == b[index]:
        index += 1
    return index


def _special_token_ids(tokenizer) -> frozenset[int]:
    """The ids `skip_special_tokens=True` drops: the backend's added tokens marked special."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        added = backend.get_added_tokens_decoder()
        return frozenset(token_id for token_id, token in added.items() if token.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


def _owner(cls: type, method: str) -> str:
    """The module of the class in `cls`'s MRO that defines `method`."""
    return next((klass.__module__ for klass in cls.__mro__ if method in vars(klass)), "")


@cache
def _keeps_transformers_decode(cls: type) -> bool:
    """Whether a tokenizer class decodes as transformers' fast tokenizers do (once per class, not per stream)."""
    return _owner(cls, "decode") == "transformers.tokenization_utils_base" and _owner(cls, "_decode") in (
        "transformers.tokenization_utils_tokenizers",  # transformers 5's TokenizersBackend
        "transformers.tokenization_utils_fast",  # transformers 4's PreTrainedTokenizerFast
    )


def _raw_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> `tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`.

    Where the tokenizer keeps transformers' own decode over its Rust backend (most fast tokenizers), that is the
    backend's decode, called directly: each generated token decodes twice, and transformers' layers cost a third
    of each call (11.2 against 7.0 us for a few WordPiece ids on an AVX2 EPYC). A class that overrides either
    method (Whisper's, CodeGen's) keeps its own."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls: type = type(tokenizer)
    if backend is not None and _keeps_transformers_decode(cls):
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _cleans_up_spaces(tokenizer) -> bool:
    """Whether `tokenizer.decode` applies `clean_up_tokenization` by default (mirrors transformers 5)."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        # transformers skips the cleanup for BPE models unless forced: it would corrupt their text.
        flag = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        return bool(getattr(tokenizer, flag, False))
    return True


class _TokenWindow:
    """Token ids -> raw text deltas, decoding only a short window of recent tokens."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        # Special ids never reach the window; cleanup is a later stage, applied to the whole stream.
        self._decode = _raw_decoder(tokenizer)
        # Tokens since the last release (the unread ones) after the context: the tokens of that release.
        self._window_ids = prompt_ids[-_INITIAL_CONTEXT_TOKENS:]
        self._num_context = len(self._window_ids)
        self._context_text = self._decode(self._window_ids)

    def add(self, token_id: int) -> str:
        self._window_ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """The unread tokens' text, an incomplete character's U+FFFD included (as the full decode has it)."""
        if len(self._window_ids) == self._num_context:
            return ""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        window_text = self._decode(self._window_ids)
        num_unread = len(self._window_ids) - self._num_context
        if not final and window_text.endswith(_REPLACEMENT_CHAR) and num_unread < _MAX_UNREAD_TOKENS:
            return ""  # the last character's remaining bytes come in the next tokens
        # Normally the window's text extends the context's; where it does not (the prompt ended inside a
        # character), the differing part is new text.
        delta = window_text[_common_prefix_len(window_text, self._context_text) :]
        del self._window_ids[: self._num_context]
        self._num_context = len(self._window_ids)
        if not final:
            self._context_text = self._decode(self._window_ids)
        return delta


def _is_safe_cleanup_cut(text: str, cut: int) -> bool:
    """True when no cleanup pattern can start before `cut` and end after it, whatever text follows.

    Every pattern starts with a space and the cleanup only deletes spaces, so it is enough that no space
    in the last few characters before the cut begins a prefix of a pattern.
    """
    for start in range(max(cut - _CLEANUP_REACH, 0), cut):
        if text[start] == " ":
            tail = text[start:cut]
            if any(pattern.startswith(tail) for pattern in _CLEANUP_PATTERNS):
                return False
    return True


def _last_cleanup_cut(text: str) -> int:
    """The last safe cut in `text` (0: none yet); cuts anyway when pathological text holds too much."""
    for cut in range(len(text), max(len(text) - 2 * _CLEANUP_REACH, 0), -1):
        if _is_safe_cleanup_cut(text, cut):
            return cut
    if len(text) > _MAX_CLEANUP_PENDING:
        return len(text) - 2 * _CLEANUP_REACH
    return 0


class _SpaceCleanupStream:
    """Raw text deltas -> `clean_up_tokenization` applied to the whole stream, in safe chunks.

    Chunks are cut where no pattern spans the cut, so cleaning them one by one equals cleaning the whole
    text. The prompt's raw tail since its last safe cut starts the stream, so a pattern joining the prompt
    to the first generated text is cleaned as the full decode cleans it.
    """

    def __init__(self, clean: Callable[[str], str], raw_prompt_text: str) -> None:
        self._clean = clean
        cut = _last_cleanup_cut(raw_prompt_text)
        self._pending_raw = raw_prompt_text[cut:]
        # The part of the prompt's decoded text the pending raw text stands for: already shown.
        self._shown = clean(self._pending_raw)

    def push(self, raw_text: str, final: bool) -> str:
        self._pending_raw += raw_text
        cut = len(self._pending_raw) if final else _last_cleanup_cut(self._pending_raw)
        if cut == 0:
            return ""
        cleaned = self._clean(self._pending_raw[:cut])
        self._pending_raw = self._pending_raw[cut:]
        common = _common_prefix_len(cleaned, self._shown)
        new_text = cleaned[common:]
        self._shown = self._shown[common:] if not new_text else ""
        return new_text


class _StopMatcher:
    """Text deltas -> the text that cannot be part of a stop string; finds the earliest stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = tuple(s for s in stop if s)  # an empty stop string would end every generation at once
        self._buffer = ""

    def push(self, text: str, final: bool) -> tuple[str, bool]:
        """(text to release, whether a stop string matched)."""
        if not self._stops:
            return text, False
        # Held text is shorter than any stop string, so a new match can only start in it or after it.
        buffer = self._buffer + text
        stop_index = self._first_stop_index(buffer)
        if stop_index is not None:
            self._buffer = ""
            return buffer[:stop_index], True
        num_held = 0 if final else self._stop_prefix_len(buffer)
        self._buffer = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], False

    def _first_stop_index(self, text: str) -> int | None:
        """Where the text ends at the first character that completes a stop string: before the earliest
        stop string that character completes. Judged per character, so how the tokens split the text
        does not change where it ends ("hal" with stops "half" and "al" ends at "h")."""
        matches = [(index + len(s), index) for s in self._stops if (index := text.find(s)) >= 0]
        if not matches:
            return None
        first_end = min(end for end, _ in matches)
        return min(index for end, index in matches if end == first_end)

    def _stop_prefix_len(self, text: str) -> int:
        """The longest end of `text` that is the start of a stop string (shorter than the whole of it)."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


class IncrementalDetokenizer:
    """One generation request's streamed text; `add` each generated token, `flush` at the end.

    `flush` releases the held-back text: the start of a stop string that did not complete, and the
    U+FFFD of a character whose bytes never completed (the full decode shows the same).
    Empty stop strings are ignored. Streamed text is never taken back, so it can differ from the full
    decode only for invalid bytes: more than 8 tokens in a row that leave a character incomplete, or a
    byte-fallback run that an invalid byte later turns into U+FFFDs (that decoder replaces the whole run).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._special_ids = _special_token_ids(tokenizer)
        # `skip_special_tokens` drops special tokens before the decoder runs, so dropping them here decodes
        # the same text and keeps them out of the window.
        prompt_ids = [token_id for token_id in prompt_token_ids if token_id not in self._special_ids]
        self._tokens = _TokenWindow(tokenizer, prompt_ids)
        self._cleanup: _SpaceCleanupStream | None = None
        if _cleans_up_spaces(tokenizer):
            # Decoded once (O(prompt)) to find where its cleaned text can be continued exactly.
            raw_prompt_text = tokenizer.decode(prompt_ids, clean_up_tokenization_spaces=False)
            self._cleanup = _SpaceCleanupStream(tokenizer.clean_up_tokenization, raw_prompt_text)
        self._stops = _StopMatcher(stop)
        self._released: list[str] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All text released so far (the `add` and `flush` outputs joined)."""
        return "".join(self._released)

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the new text that is safe to stream now (may be "")."""
        if self.stopped or token_id in self._special_ids:
            return ""
        return self._release(self._tokens.add(token_id), final=False)

    def flush(self) -> str:
        """The held-back text, at the end of the generation; nothing after a stop string."""
        if self.stopped:
            return ""
        return self._release(self._tokens.flush(), final=True)

    def _release(self, raw_text: str, final: bool) -> str:
        text = raw_text if self._cleanup is None else self._cleanup.push(raw_text, final)
        if not text and not final:
            return ""
        text, self.stopped = self._stops.push(text, final)
        if text:
            self._released.append(text)
        return text
