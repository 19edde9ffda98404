"""MultiVectorEncoder models' inputs, as sentence-transformers 6.2 makes them: how queries and documents are
tokenized, and which token vectors are returned (MaxSim rerank: engine/tasks/multi_vector.py).

- The task comes from the call's prompt_name: "query" is encode_query, "document" encode_document; any other
  name (or none) is encode() without a task, with that prompt (or the model's default one).
- encode_query / encode_document use the model's "query" / "document" prompt ("" when it has none); the
  text, prompt first, is cut at query_length / document_length tokens (special tokens included), else at
  the model's limit. Longer inputs are refused unless the call sets truncate, as for Embed.
- Query expansion pads queries shorter than its length with the expansion token ([MASK] by default) on the
  tokenizer's padding side; "fixed" also makes `length` the queries' cap. The model attends to those tokens
  (attend true; models/loading/multi_vector_files.py refuses attend false) and they are returned.
- Returned: every token's vector, special and prompt tokens included, except on the skiplist tasks (a call
  without a task counts as "document") the skiplist words' tokens, and outside queries the tokens not in
  keep_only_token_ids when the model sets it (MultiVectorMask).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import tokenizers

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.errors import ConfigError, InvalidInput
from embedserv.models.loading.multi_vector_files import MultiVectorSettings
from embedserv.types import EmbedParams, TruncationDirection

QUERY, DOCUMENT = "query", "document"


def task_of(prompt_name: str | None) -> str | None:
    """The MultiVectorEncoder task a call's prompt name selects (None: encode() without a task)."""
    return prompt_name if prompt_name in (QUERY, DOCUMENT) else None


class MultiVectorRules(TokenRules):
    def __init__(
        self, tokenizer: TextTokenizer, settings: MultiVectorSettings, max_positions: int, source: str = "the model"
    ) -> None:
        """Refuses (ConfigError, at start-up) what the tokenizer makes impossible to run as the library does;
        `source` names the model in those messages."""
        hf = tokenizer.hf_tokenizer
        # A private copy: truncation and padding are mutable settings of the Rust object.
        self._backend = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
        self._backend.no_padding()
        self._backend.no_truncation()
        self._num_special = self._backend.num_special_tokens_to_add(False)
        self.settings = settings
        self.max_input_tokens = tokenizer.max_input_tokens
        self.max_positions = max_positions
        # MultiVectorEncoder always has these prompts, empty unless the model sets them (so encode_query
        # never falls back to the default prompt).
        for name in (QUERY, DOCUMENT):
            tokenizer.prompts.setdefault(name, "")
        self._pad_left = hf.padding_side == "left"
        self._skip_ids = _skiplist_ids(hf, settings.skiplist_words)
        keep = settings.keep_only_token_ids
        self._keep_only = np.asarray(keep, dtype=np.int64) if keep else None
        try:
            self._expansion_id = _expansion_id(hf, settings)
            self._check_lengths()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def _check_lengths(self) -> None:
        s, tokens = self.settings, self._num_special
        for name, value in (("query_length", s.query_length), ("document_length", s.document_length)):
            if value is not None and value <= tokens:
                raise ConfigError(f"{name} {value} leaves no room for text beside the {tokens} special tokens")
        if s.expansion is not None:
            if s.expansion.strategy == "min" and self._pad_left:
                # "min" widens a left-padded batch on the right, so which pads become expansion tokens
                # depends on the other queries of the batch; a query's vectors would not be its own.
                raise ConfigError(
                    "query_expansion strategy min with a left-padding tokenizer is not served: sentence-transformers' "
                    "expansion then depends on the other queries of its batch"
                )
            if not tokens < s.expansion.length <= self.max_positions:
                raise ConfigError(
                    f"query_expansion length {s.expansion.length} must be above the {tokens} special tokens and "
                    f"within the model's {self.max_positions} positions"
                )

    def _limits(self, task: str | None) -> tuple[int, int]:
        """(the most tokens an input may have, the length queries are expanded to or 0) for a task."""
        s, expansion = self.settings, self.settings.expansion if task == QUERY else None
        if expansion is not None and expansion.strategy == "fixed":
            return expansion.length, expansion.length
        cap = s.query_length if task == QUERY else s.document_length if task == DOCUMENT else None
        if expansion is not None and cap is not None:
            cap = max(cap, expansion.length)
        # Past the positions the library's model fails; here the input is refused or cut there.
        limit = min(cap, self.max_positions) if cap is not None else self.max_input_tokens
        return limit, expansion.length if expansion is not None else 0

    def text_encoder(self, tokenizer: TextTokenizer) -> Callable[[list[str], EmbedParams], list[InputSequence]]:
        return partial(self.encode, tokenizer)

    def encode(self, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> list[InputSequence]:
        prompt = tokenizer.resolve_prompt(params.prompt_name)
        task = task_of(params.prompt_name)
        return self.encode_task(tokenizer, texts, task, prompt, params.truncate, params.truncation_direction)

    def encode_task(
        self,
        tokenizer: TextTokenizer,
        texts: list[str],
        task: str | None,
        prompt: str,
        truncate: bool,
        direction: TruncationDirection,
        what: str = "input {}",
    ) -> list[InputSequence]:
        """Token ids as the library's Transformer.preprocess makes them for `task`, without padding. `what`
        names an input in errors (formatted with its index)."""
        limit, expand_to = self._limits(task)
        prepared = [prompt + t for t in texts]
        if tokenizer.do_lower_case:
            prepared = [t.lower() for t in prepared]
        room = limit - self._num_special
        out = []
        for index, encoding in enumerate(self._backend.encode_batch(prepared, add_special_tokens=False)):
            if len(encoding.ids) > room:
                if not truncate:
                    raise InvalidInput(
                        f"{what.format(index)} has {len(encoding.ids) + self._num_special} tokens, more than the "
                        f"{limit} the model takes {_for_task(task)}; shorten it or set truncate"
                    )
                encoding.truncate(room, direction=str(direction))
            ids = self._backend.post_process(encoding, None, True).ids
            if len(ids) < expand_to:
                expansion = [self._expansion_id] * (expand_to - len(ids))
                ids = expansion + ids if self._pad_left else ids + expansion
            out.append(InputSequence(ids=ids))
        return out

    def keep(self, encoded: InputSequence, params: EmbedParams) -> np.ndarray | slice:
        return self.keep_for(encoded.ids, task_of(params.prompt_name))

    def keep_for(self, ids: list[int], task: str | None) -> np.ndarray | slice:
        """MultiVectorMask: every token (padding aside, which these sequences have none of), less the skiplist
        on its tasks, and outside queries only keep_only_token_ids when the model sets them."""
        keep = None
        array = np.asarray(ids, dtype=np.int64)
        if self._skip_ids is not None and (task or DOCUMENT) in self.settings.skiplist_tasks:
            keep = ~np.isin(array, self._skip_ids)
        if task != QUERY and self._keep_only is not None:
            allowed = np.isin(array, self._keep_only)
            keep = allowed if keep is None else keep & allowed
        return slice(None) if keep is None else keep

    def encode_for_maxsim(
        self, tokenizer: TextTokenizer, query: str, documents: list[str], truncate: bool
    ) -> list[InputSequence]:
        """The query as encode_query makes it (never cut), then the documents as encode_document does."""
        right = TruncationDirection.RIGHT
        try:
            encoded = self.encode_task(tokenizer, [query], QUERY, tokenizer.prompts[QUERY], False, right, "the query")
        except InvalidInput as exc:
            raise InvalidInput(f"{exc} (queries are never truncated)") from None
        prompt = tokenizer.prompts[DOCUMENT]
        return encoded + self.encode_task(tokenizer, documents, DOCUMENT, prompt, truncate, right, "document {}")


def _for_task(task: str | None) -> str:
    return f"as a {task}" if task else "without a task"


def _expansion_id(hf, settings: MultiVectorSettings) -> int | None:
    """The expansion token's id as Transformer.preprocess picks it; its checks, at start-up."""
    expansion = settings.expansion
    if expansion is None:
        return None
    if expansion.token is None:
        token_id = hf.mask_token_id if hf.mask_token_id is not None else hf.eos_token_id
        if token_id is None:
            raise ConfigError(
                "query_expansion names no token and the tokenizer has neither a mask nor an EOS token to expand "
                "queries with; set query_expansion's token"
            )
        return int(token_id)
    token_id = hf.convert_tokens_to_ids(expansion.token)
    if token_id is None or (token_id == hf.unk_token_id and expansion.token != hf.unk_token):
        raise ConfigError(f"query_expansion token {expansion.token!r} is not in the tokenizer's vocabulary")
    return int(token_id)


def _skiplist_ids(hf, words: tuple[str, ...]) -> np.ndarray | None:
    """MultiVectorMask.resolve_with_tokenizer: each word's token id; words that are not one token (they
    resolve to the unknown token) are dropped, as the library drops them."""
    ids = []
    for word in words:
        token_id = hf.convert_tokens_to_ids(word)
        if hf.unk_token_id is not None and token_id == hf.unk_token_id and word != hf.unk_token:
            continue
        ids.append(token_id)
    return np.asarray(ids, dtype=np.int64) if ids else None
