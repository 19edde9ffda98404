"""Late chunking (EmbedParams.late_chunking): one vector per chunk of each input, pooled from the token states of
the whole input rather than from the chunk embedded alone.

The model runs once over each input as Embed would feed it (the call's prompt and the model's special tokens
included); an input longer than the model's context runs as overlapping windows (chunk_spans.py says which
window each token's state comes from). Each chunk's vector is the mean of its own tokens' final hidden states,
whatever pooling the model's dense output uses (late chunking's pooling; a CLS or last-token model gets
the mean too), then the model's sentence-transformers Dense modules if it has them (HostDense), `dimensions`
and normalization; quantize.py applies the call's encoding after, as for Embed. Usage counts every token
run, windows' repeated tokens included.

Refused: models whose token vectors are not their hidden states (bge-m3's colbert head, MultiVectorEncoders,
sparse models), other outputs than dense, and chunking together with late chunking. `truncate` and
`truncation_direction` do not apply: nothing is too long, so nothing is cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.engine.ports import Core, SequenceOutput
from embedserv.engine.served_model import ServedModel
from embedserv.engine.tasks import chunk_spans
from embedserv.engine.tasks.outputs import finish_embeddings
from embedserv.errors import InvalidInput
from embedserv.models.heads.pooling import Dense
from embedserv.models.loading.weights import load_dense_weights
from embedserv.types import ChunkSplitter, EmbedOutput, EmbedParams, EmbedResult, LateChunking, TokenizedText


@dataclass(frozen=True)
class InputPlan:
    """What one input runs as and how its chunks are pooled."""

    windows: list[InputSequence]
    # Per window: the text tokens [first, stop) whose states it gives, and the row of token `first` in it.
    pieces: list[tuple[int, int, int]]
    spans: tuple[tuple[int, int], ...]
    # Per chunk: its text tokens (indices into the input's text tokens).
    members: list[np.ndarray]


def check_late_chunking(served: ServedModel, texts: list[str], params: EmbedParams) -> None:
    """Everything about the call that can be refused before tokenizing."""
    info, late = served.info, params.late_chunking
    if params.chunking:
        raise InvalidInput("chunking and late_chunking cannot be combined; late chunking already handles long inputs")
    if tuple(params.outputs) != (EmbedOutput.DENSE,):
        raise InvalidInput("late_chunking gives dense vectors only; ask for outputs [dense] alone")
    if served.spec.outputs.head_kind != "hidden":
        raise InvalidInput(f"model {info.name!r} cannot late-chunk: its token vectors are not its final hidden states")
    _check_options(late, texts)


def _check_options(late: LateChunking, texts: list[str]) -> None:
    if late.splitter is not ChunkSplitter.SPANS and late.spans:
        raise InvalidInput(f"late_chunking.spans apply to the spans splitter, not {late.splitter}; leave them empty")
    if late.splitter is not ChunkSplitter.TOKENS and (late.chunk_tokens or late.overlap_tokens):
        raise InvalidInput(
            f"chunk_tokens and overlap_tokens apply to the tokens splitter, not {late.splitter}; leave them 0"
        )
    if late.splitter is ChunkSplitter.SPANS:
        if len(late.spans) != len(texts):
            raise InvalidInput(
                f"late_chunking.spans has {len(late.spans)} entries for {len(texts)} inputs; "
                "send one per input, in order"
            )
        for index, (text, spans) in enumerate(zip(texts, late.spans, strict=True)):
            chunk_spans.check_spans(index, text, spans)
    if late.splitter is ChunkSplitter.TOKENS:
        if late.chunk_tokens < 1:
            raise InvalidInput("the tokens splitter needs chunk_tokens of at least 1")
        if not 0 <= late.overlap_tokens < late.chunk_tokens:
            raise InvalidInput(
                f"overlap_tokens must be at least 0 and less than chunk_tokens ({late.chunk_tokens}), "
                f"not {late.overlap_tokens}"
            )


def plan_inputs(tokenizer: TextTokenizer, texts: list[str], params: EmbedParams, adapter: int) -> list[InputPlan]:
    """Every input's windows and chunks (tokenizer work: run it in the tokenizer pool)."""
    prompt_chars = len(tokenizer.resolve_prompt(params.prompt_name))
    tokenized = tokenizer.tokenize(texts, add_special_tokens=True, prompt_name=params.prompt_name)
    return [
        plan_input(index, text, tokens, prompt_chars, tokenizer.max_input_tokens, params.late_chunking, adapter)
        for index, (text, tokens) in enumerate(zip(texts, tokenized, strict=True))
    ]


def plan_input(
    index: int, text: str, tokens: TokenizedText, prompt_chars: int, limit: int, late: LateChunking, adapter: int
) -> InputPlan:
    """One input's windows (the model's special tokens and the prompt's tokens in each) and chunks."""
    ids, special = tokens.ids, np.asarray(tokens.special, dtype=bool)
    content = np.flatnonzero(~special)
    # The special tokens the model adds before and after the content (prompt and text).
    lead = int(content[0]) if content.size else len(ids)
    tail = int(content[-1]) + 1 if content.size else len(ids)
    offsets = np.asarray(tokens.offsets[lead:tail], dtype=np.int64).reshape(-1, 2)
    prompt_tokens = int(np.count_nonzero(offsets[:, 0] < prompt_chars)) if prompt_chars else 0
    text_offsets = np.maximum(offsets[prompt_tokens:] - prompt_chars, 0)
    head, after = ids[: lead + prompt_tokens], ids[tail:]
    room = limit - len(head) - len(after)
    if len(ids) > limit and room < 1:
        raise InvalidInput(
            f"the prompt takes {prompt_tokens} tokens, which leaves no room for text within the model's limit of "
            f"{limit} tokens; use a shorter prompt_name"
        )
    windows = chunk_spans.context_windows(len(text_offsets), room) if len(ids) > limit else [(0, len(text_offsets))]
    encoded, pieces = [], []
    for (first, stop), (own_first, own_stop) in zip(windows, chunk_spans.owned_tokens(windows), strict=True):
        window_ids = ids if len(windows) == 1 else head + ids[len(head) + first : len(head) + stop] + after
        encoded.append(InputSequence(ids=list(window_ids), adapter=adapter))
        pieces.append((own_first, own_stop, len(head) + own_first - first))
    spans = _chunk_spans(index, text, text_offsets, late)
    members = chunk_spans.span_members(index, text_offsets, spans)
    return InputPlan(encoded, pieces, tuple(spans), members)


def _chunk_spans(index: int, text: str, offsets: np.ndarray, late: LateChunking) -> list[tuple[int, int]]:
    if late.splitter is ChunkSplitter.SPANS:
        return [(int(start), int(end)) for start, end in late.spans[index]]
    if late.splitter is ChunkSplitter.TOKENS:
        return chunk_spans.token_window_spans(offsets, late.chunk_tokens, late.overlap_tokens)
    # A sentence of characters the tokenizer drops (no token) has nothing to pool: it is left out.
    spans = chunk_spans.sentence_spans(text)
    return [span for span in spans if _covers_token(offsets, span)]


def _covers_token(offsets: np.ndarray, span: tuple[int, int]) -> bool:
    return bool(np.any(np.minimum(offsets[:, 1], span[1]) - np.maximum(offsets[:, 0], span[0]) > 0))


def chunk_rows(plan: InputPlan, outputs: list[SequenceOutput]) -> np.ndarray:
    """[chunks, hidden] float32: each chunk's mean token state, the states stitched from the input's windows."""
    states = np.concatenate(
        [
            output.vectors[row : row + stop - first]
            for (first, stop, row), output in zip(plan.pieces, outputs, strict=True)
        ]
    )
    return chunk_spans.mean_rows(states, plan.members)


class HostDense:
    """The model's sentence-transformers Dense modules, float32 on the host's CPU. Chunks are pooled on the
    host, and the workers' Dense layers only ever see the rows their pooler makes, so a copy runs here (where
    the workers run a bfloat16 model in bfloat16, this copy is the more exact)."""

    def __init__(self, served: ServedModel, allow_pickle: bool) -> None:
        self._specs = served.spec.st.dense
        self._allow_pickle = allow_pickle
        self._layers: list[Dense] | None = None

    @property
    def is_loaded(self) -> bool:
        return self._layers is not None or not self._specs

    def load(self) -> None:
        """Reads the weights (files: run it in the tokenizer pool); once."""
        layers = []
        for spec in self._specs:
            layer = Dense(spec)
            load_dense_weights(layer, spec.directory, self._allow_pickle)
            layers.append(layer.float().eval().requires_grad_(False))
        self._layers = layers

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        if not self._specs:
            return rows
        if len(rows) == 0:
            return np.zeros((0, self._specs[-1].out_features), dtype=np.float32)
        out = torch.from_numpy(rows)
        with torch.inference_mode():
            for layer in self._layers:
                out = layer(out)
        return out.float().numpy()


async def embed_late_chunks(
    core: Core,
    served: ServedModel,
    texts: list[str],
    params: EmbedParams,
    received: float,
    dense: HostDense,
    adapter: int = -1,
) -> EmbedResult:
    """Per input, its chunks' spans and float32 vectors (EmbedResult.chunks); quantize.py encodes them after."""
    check_late_chunking(served, texts, params)
    if not dense.is_loaded:
        await core.tokenize_with(dense.load)
    plans = await core.tokenize_with(plan_inputs, served.tokenizer, texts, params, adapter, chars=sum(map(len, texts)))
    flat = [window for plan in plans for window in plan.windows]
    outputs, prompt_tokens, timing = await core.infer(
        flat, received, (EmbedOutput.MULTI_VECTOR,), use_cache=not params.bypass_cache
    )
    chunks, start = [], 0
    for plan in plans:
        rows = dense(chunk_rows(plan, outputs[start : start + len(plan.windows)]))
        start += len(plan.windows)
        chunks.append((plan.spans, finish_embeddings(rows, params.dimensions, params.normalize)))
    return EmbedResult(embeddings=None, prompt_tokens=prompt_tokens, timing=timing, chunks=chunks)
