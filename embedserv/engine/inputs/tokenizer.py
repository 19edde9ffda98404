"""Tokenization exactly as the reference libraries do it, with our own truncation and limit checks.

The tokenizer is built by transformers' AutoTokenizer (so model types whose tokenizer class transformers
forces come out the same), and its Rust backend does the work. Texts are encoded without special tokens,
truncated here (per request, either side), then post-processed to add the special tokens: the same steps
the backend takes when it truncates itself, without sharing mutable truncation state between requests.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import tokenizers
from transformers import AutoTokenizer

from embedserv.engine.inputs import text_prefix
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.errors import InvalidInput
from embedserv.models.loading.tasks import YesNoTemplate
from embedserv.types import EmbedParams, TokenizedText, TruncationDirection

# Our tokenizer threads are the parallelism; the Rust library's own thread pool would compete with the
# model for the same cores (measured: ~15% slower batches on 2 cores).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


T = TypeVar("T")

# Up to this many characters (about 1 ms of tokenizing) a call is tokenized on the event loop: handing it to
# the tokenizer thread and back cost more than that under load, in GIL waits and wake-ups (one-text calls
# 1.1-1.5x faster on 2 cores; docs/performance-history.md, issue 34). Longer inputs go to the pool, so the loop never
# stalls on them.
INLINE_TOKENIZE_CHARS = 4096


class TokenizerPool:
    """Where a model's tokenizer work runs: the event loop for short inputs, else its tokenizer threads."""

    def __init__(self, threads: int, name: str) -> None:
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix=f"tokenize-{name}")

    async def run(self, encode: Callable[..., T], args: tuple[Any, ...], chars: int | None) -> T:
        """`encode(*args)`, here when the caller says the inputs hold at most INLINE_TOKENIZE_CHARS characters
        (`chars`), else in a tokenizer thread."""
        if chars is not None and chars <= INLINE_TOKENIZE_CHARS:
            return encode(*args)
        return await asyncio.get_running_loop().run_in_executor(self._threads, encode, *args)

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


_FOREIGN_IDS = (
    "; token ids must come from this model's tokenizer (LangChain's OpenAIEmbeddings: give it "
    "check_embedding_ctx_length=False), or send texts"
)


class TextTokenizer:
    def __init__(
        self,
        model_dir: Path,
        max_input_tokens: int,
        do_lower_case: bool = False,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
        include_prompt: bool = True,
        pad_texts: bool = False,
        fallback_pad_id: int = 0,
    ) -> None:
        """`pad_texts`: texts (and token-id inputs) are padded to `max_input_tokens` with the tokenizer's pad token,
        else `fallback_pad_id`, as the model's processor pads them (SigLIP: padding="max_length"; its text tower
        reads the last position, a pad)."""
        # Never the tokenizer code a model directory may ship (tokenizer_config.json's auto_map).
        hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
        if not hf_tokenizer.is_fast:
            raise ValueError(f"{model_dir}: a fast (tokenizer.json) tokenizer is required")
        # A private copy: padding and truncation are mutable settings of the Rust object.
        self.backend = tokenizers.Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
        self.backend.no_padding()
        self.backend.no_truncation()
        self._cuts_safely = text_prefix.cuts_safely(self.backend)  # texts cut from the right: from a prefix
        # Decoding generated text (engine/core/detokenizer.py) goes through transformers' own decode.
        self.hf_tokenizer = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self._special_ids = set(hf_tokenizer.all_special_ids)
        self.num_special = self.backend.num_special_tokens_to_add(False)
        self.num_pair_special = self.backend.num_special_tokens_to_add(True)
        # BERT feeds segment ids (0 query, 1 document); RoBERTa and XLM-R tokenizers do not.
        self.feeds_token_types = "token_type_ids" in hf_tokenizer.model_input_names
        self.max_input_tokens = max_input_tokens
        self.do_lower_case = do_lower_case
        self.prompts = dict(prompts or {})
        self.default_prompt_name = default_prompt_name
        self.include_prompt = include_prompt
        self._prompt_lengths: dict[str, int] = {}
        self._pad_to = max_input_tokens if pad_texts else 0
        self._pad_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else fallback_pad_id
        # A yes/no reranker's prompt template's prefix and suffix ids (pairs.py), tokenized once.
        self.template_cache: dict[YesNoTemplate, tuple[list[int], list[int]]] = {}

    def resolve_prompt(self, prompt_name: str | None) -> str:
        """The prompt text for a name; None means the model's default prompt (if any)."""
        name = prompt_name or self.default_prompt_name
        if not name:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) if self.prompts else "none: this model defines no prompts"
            raise InvalidInput(f"unknown prompt_name {name!r}; known prompt names: {known}")
        return self.prompts[name]

    def _prompt_pool_start(self, prompt: str) -> int:
        """Prompt tokens to skip in pooling; like sentence-transformers, a trailing special token is not one."""
        if not prompt or self.include_prompt:
            return 0
        if prompt not in self._prompt_lengths:
            ids = self.backend.encode(self.prepare(prompt), add_special_tokens=True).ids
            length = len(ids) - (1 if ids and ids[-1] in self._special_ids else 0)
            self._prompt_lengths[prompt] = length
        return self._prompt_lengths[prompt]

    def prepare(self, text: str) -> str:
        return text.lower() if self.do_lower_case else text

    def encode_batch(
        self,
        texts: list[str],
        truncate: bool,
        direction: TruncationDirection = TruncationDirection.RIGHT,
        prompt_name: str | None = None,
    ) -> list[InputSequence]:
        """Token ids with special tokens; too-long texts are cut (truncate) or refused."""
        prompt = self.resolve_prompt(prompt_name)
        pool_start = self._prompt_pool_start(prompt)
        out = []
        for encoding in self._encodings([prompt + t for t in texts], truncate, direction):
            ids = encoding.ids
            out.append(InputSequence(ids=self._padded(ids) if self._pad_to else ids, pool_start=pool_start))
        return out

    def encode_with_offsets(
        self, texts: list[str], truncate: bool, direction: TruncationDirection = TruncationDirection.RIGHT
    ) -> list[TokenizedText]:
        """encode_batch's tokens (no prompt) with their text and character offsets, for ClassifyTokens."""
        return [_tokenized(encoding) for encoding in self._encodings(texts, truncate, direction)]

    def _encodings(self, texts: list[str], truncate: bool, direction: TruncationDirection) -> list[tokenizers.Encoding]:
        """Each text's encoding with special tokens, cut to the model's limit (truncate) or refused."""
        prepared = [self.prepare(t) for t in texts]
        room = self.max_input_tokens - self.num_special
        if truncate and direction is TruncationDirection.RIGHT and self._cuts_safely:
            encodings = text_prefix.encode_for_room(self.backend, prepared, room)
        else:
            encodings = self.backend.encode_batch(prepared, add_special_tokens=False)
        out = []
        for index, encoding in enumerate(encodings):
            if len(encoding.ids) > room:
                if not truncate:
                    raise self.too_long(f"input {index}", len(encoding.ids) + self.num_special, self.max_input_tokens)
                encoding.truncate(room, direction=direction)
            out.append(self.backend.post_process(encoding, None, True))
        return out

    def tokens_to_string(self, tokens: list[str]) -> str:
        """transformers' convert_tokens_to_string: the tokenizer's decoder over the tokens."""
        decoder = self.backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    @property
    def is_word_aware(self) -> bool:
        """Its model marks word-continuing tokens (WordPiece's `##`), as transformers' pipeline asks."""
        return bool(getattr(self.backend.model, "continuing_subword_prefix", None))

    def encode_texts(self, texts: list[str], params: EmbedParams) -> list[InputSequence]:
        """Embed's texts: encode_batch with the call's truncation and prompt."""
        return self.encode_batch(texts, params.truncate, params.truncation_direction, params.prompt_name)

    def _padded(self, ids: list[int]) -> list[int]:
        missing = self._pad_to - len(ids)
        return ids + [self._pad_id] * missing if missing > 0 else ids

    def check_token_ids(
        self, token_ids: list[list[int]], truncate: bool, direction: TruncationDirection
    ) -> list[InputSequence]:
        """Pre-tokenized inputs (OpenAI's token-id `input`), used as given: no special tokens are added. Ids must be
        this model's (LangChain's OpenAIEmbeddings sends tiktoken's by default); too-long ones are cut or refused."""
        out = []
        for index, ids in enumerate(token_ids):
            if not ids:
                raise InvalidInput(f"input {index} has no token ids; send at least one")
            self._check_vocabulary(ids, f"input {index}", _FOREIGN_IDS)
            if len(ids) > self.max_input_tokens:
                if not truncate:
                    raise self.too_long(f"input {index}", len(ids), self.max_input_tokens)
                ids = (
                    ids[-self.max_input_tokens :]
                    if direction is TruncationDirection.LEFT
                    else ids[: self.max_input_tokens]
                )
            out.append(InputSequence(ids=self._padded(list(ids)) if self._pad_to else list(ids)))
        return out

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The model's chat template applied to `messages`, with the assistant's turn opened."""
        if not getattr(self.hf_tokenizer, "chat_template", None):
            raise InvalidInput(
                "this model has no chat template (tokenizer_config.json's chat_template); "
                "use /v1/completions with a prompt you format yourself"
            )
        try:
            return self.hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise InvalidInput(f"the model's chat template cannot render these messages: {exc}") from None

    def _check_vocabulary(self, ids: list[int], what: str, hint: str = "") -> None:
        vocab = self.backend.get_vocab_size(with_added_tokens=True)
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise InvalidInput(f"{what} holds token id {bad}, outside the model's vocabulary 0..{vocab - 1}{hint}")

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self._check_vocabulary(ids, "ids")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def add_special_tokens(self, tokens: list[str]) -> None:
        """Special tokens a model's processor adds to its tokenizer when it is built (ColModernVBERT's image
        tokens), added as it adds them; those the tokenizer has already change nothing. Start-up only."""
        self.hf_tokenizer.add_special_tokens({"additional_special_tokens": tokens})
        self.backend = tokenizers.Tokenizer.from_str(self.hf_tokenizer.backend_tokenizer.to_str())
        self.backend.no_padding()
        self.backend.no_truncation()
        self._special_ids = set(self.hf_tokenizer.all_special_ids)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A generation prompt with the model's special tokens, as `tokenizer(text)` gives it (without them
        for a chat template's output); the engine checks its length against the model's context."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """Tokens of a text without special tokens (an encoder-decoder model's decoder prompt)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def too_long(self, what: str, tokens: int, limit: int) -> InvalidInput:
        return InvalidInput(
            f"{what} has {tokens} tokens, more than the model's limit of {limit}; shorten it or set truncate"
        )

    def encode_windows(self, texts: list[str], prompt_name: str | None = None) -> list[list[InputSequence]]:
        """Chunked Embed's inputs: each text as windows of at most the model's limit, each window wrapped in
        the special tokens and led by the prompt (pooled from pool_start, as encode_batch does). A text that
        fits is one window, exactly as encode_batch makes it; a longer one is split, without overlap, into
        windows of (limit - special tokens - prompt tokens) of its own tokens."""
        prompt = self.resolve_prompt(prompt_name)
        pool_start = self._prompt_pool_start(prompt)
        room = self.max_input_tokens - self.num_special
        prompt_encoding = self.backend.encode(self.prepare(prompt), add_special_tokens=False)
        size = room - len(prompt_encoding.ids)
        if size < 1:
            raise InvalidInput(
                f"the prompt takes {len(prompt_encoding.ids)} tokens, which leaves no room for text within the "
                f"model's limit of {self.max_input_tokens} tokens; use a shorter prompt_name"
            )
        encodings = self.backend.encode_batch([self.prepare(prompt + t) for t in texts], add_special_tokens=False)
        out = []
        for text, encoding in zip(texts, encodings, strict=True):
            pieces = [encoding]
            if len(encoding.ids) > room:
                content = self.backend.encode(self.prepare(text), add_special_tokens=False)
                pieces = [tokenizers.Encoding.merge([prompt_encoding, w]) for w in split_windows(content, size)]
            out.append([InputSequence(self.backend.post_process(p, None, True).ids, pool_start) for p in pieces])
        return out

    def encode_for_cosine(self, query: str, documents: list[str], truncate: bool) -> list[InputSequence]:
        """The query (never cut) and the documents with the prompts sentence-transformers' encode_query /
        encode_document pick: "query"; "document", "passage" or "corpus"; else the default prompt."""
        query_prompt, document_prompt = self._cosine_prompts()
        return self._cosine_query(query, query_prompt) + self.encode_batch(
            documents, truncate, TruncationDirection.RIGHT, document_prompt
        )

    def encode_cosine_windows(
        self, query: str, documents: list[str]
    ) -> tuple[InputSequence, list[list[InputSequence]]]:
        """Chunked Rerank's embedder inputs: the query as encode_for_cosine makes it, and each document's
        windows (encode_windows) with the document prompt."""
        query_prompt, document_prompt = self._cosine_prompts()
        return self._cosine_query(query, query_prompt)[0], self.encode_windows(documents, document_prompt)

    def _cosine_prompts(self) -> tuple[str | None, str | None]:
        prompts = self.prompts
        query_prompt = "query" if "query" in prompts else None
        document_prompt = next((n for n in ("document", "passage", "corpus") if n in prompts), None)
        return query_prompt, document_prompt

    def _cosine_query(self, query: str, prompt_name: str | None) -> list[InputSequence]:
        try:
            return self.encode_batch([query], False, TruncationDirection.RIGHT, prompt_name)
        except InvalidInput:
            raise InvalidInput(
                f"the query is longer than the model's limit of {self.max_input_tokens} tokens "
                "(queries are never truncated); shorten the query"
            ) from None

    def tokenize(
        self, texts: list[str], add_special_tokens: bool = True, prompt_name: str | None = None
    ) -> list[TokenizedText]:
        """Tokens with their text and character offsets, for the Tokenize RPC (no truncation)."""
        prompt = self.resolve_prompt(prompt_name)
        prepared = [self.prepare(prompt + t) for t in texts]
        encodings = self.backend.encode_batch(prepared, add_special_tokens=add_special_tokens)
        return [_tokenized(e) for e in encodings]


def _tokenized(encoding: tokenizers.Encoding) -> TokenizedText:
    return TokenizedText(
        ids=list(encoding.ids),
        tokens=list(encoding.tokens),
        offsets=[tuple(o) for o in encoding.offsets],
        special=[bool(m) for m in encoding.special_tokens_mask],
    )


def split_windows(encoding: tokenizers.Encoding, size: int) -> list[tokenizers.Encoding]:
    """The encoding cut into consecutive pieces of `size` tokens (the last one shorter), without overlap."""
    if len(encoding.ids) <= size:
        return [encoding]
    encoding.truncate(size, stride=0, direction="right")
    return [encoding, *encoding.overflowing]
