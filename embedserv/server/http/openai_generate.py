"""OpenAI-compatible /v1/completions and /v1/chat/completions for the models that generate.

Each prompt is one engine.generate stream (several prompts: several choices, run concurrently). Chat
messages go through the model's chat template (refused when it has none), and the rendered text is
tokenized without special tokens, as transformers' apply_chat_template(tokenize=True) does. Streams are
server-sent events, one chunk per engine delta, ending with `data: [DONE]`; an error after the first event
arrives as a `data: {"error": ...}` event before [DONE] (the status is sent by then).

Defaults are OpenAI's: temperature 1, top_p 1; max_tokens 16 for completions, and for chat as many as fit
the model's context. OpenAI fields we do not implement (n > 1, logprobs, penalties, tools, ...) are refused
when set, never ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Literal

import anyio
import orjson
from fastapi import APIRouter, Request
from pydantic import Field
from starlette.responses import StreamingResponse

from embedserv import metrics
from embedserv.engine.engine import Engine
from embedserv.errors import InvalidInput
from embedserv.server.http.common import Body, RequestBody, call_of, engine_named, frontend_of, refuse_unsupported
from embedserv.server.http.error_responses import JSON, error_body, message_of, status_of
from embedserv.types import FinishReason, GenerationDelta, SamplingParams

router = APIRouter()
_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}
_UNSUPPORTED = {
    "n": 1,
    "echo": False,
    "logprobs": None,
    "top_logprobs": None,
    "best_of": 1,
    "suffix": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "tools": None,
    "functions": None,
}


class StreamOptions(Body):
    include_usage: bool = False


class SamplingBody(RequestBody):
    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="Extension: keep the k most likely tokens; 0 keeps all.")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = 1
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = Field(False, description="Extension (vLLM's too): keep going past the end-of-sequence token.")

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        refuse_unsupported(self, _UNSUPPORTED)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
        )


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, description="null: as many as fit the model's context")
    echo: bool | None = False
    best_of: int | None = 1
    suffix: str | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict] | None = None
    functions: list[dict] | None = None
    response_format: dict | None = None


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _message_dicts(body: ChatBody, check_chars) -> list[dict]:
    messages = []
    for index, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        content = content or ""
        check_chars(content, f"messages[{index}].content")
        messages.append({"role": message.role, "content": content})
    return messages


class _Run:
    """One prompt's stream: its first delta is awaited before the response starts, so a bad prompt is an
    HTTP error rather than an event."""

    def __init__(self, index: int, deltas: AsyncIterator[GenerationDelta]) -> None:
        self.index = index
        self.deltas = deltas
        self.first: GenerationDelta | None = None

    async def start(self) -> None:
        self.first = await anext(self.deltas)

    async def all(self) -> AsyncIterator[GenerationDelta]:
        yield self.first
        if self.first.finish_reason is None:
            async for delta in self.deltas:
                yield delta


async def _merged(runs: list[_Run]) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """Every run's deltas as they come, tagged with the run's index."""
    if len(runs) == 1:
        async for delta in runs[0].all():
            yield runs[0].index, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: _Run) -> None:
        try:
            async for delta in run.all():
                await queue.put((run.index, delta))
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        finished = 0
        while finished < len(runs):
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            finished += item[1].finish_reason is not None
            yield item
    finally:
        for task in tasks:
            task.cancel()


async def _generate(
    request: Request,
    engine: Engine,
    prompts: list,
    params: SamplingParams,
    stream: bool,
    kind: str,
    include_usage: bool,
    add_special_tokens: bool = True,
):
    frontend = frontend_of(request)
    call = call_of(request)
    admitted = contextlib.ExitStack()
    admitted.enter_context(frontend.limiter.hold(len(prompts)))
    runs = [
        _Run(i, engine.core.generate(prompt, params, add_special_tokens=add_special_tokens, stream=stream))
        for i, prompt in enumerate(prompts)
    ]
    try:
        await asyncio.gather(*(run.start() for run in runs))
    except BaseException:
        await _close(runs)
        admitted.close()
        raise
    chunks = _Chunks(kind, engine.info.name, call.request_id, len(prompts))
    if not stream:
        try:
            async for index, delta in _merged(runs):
                chunks.add(index, delta)
        finally:
            await _close(runs)
            admitted.close()
        call.answered(len(prompts), chunks.prompt_tokens)
        metrics.GENERATED_TOKENS.labels(call.model).inc(chunks.completion_tokens)
        return JSON(chunks.whole())

    async def events() -> AsyncIterator[bytes]:
        try:
            async for index, delta in _merged(runs):
                yield _event(chunks.chunk(index, delta))
            call.answered(len(prompts), chunks.prompt_tokens)
            metrics.GENERATED_TOKENS.labels(call.model).inc(chunks.completion_tokens)
            if include_usage:
                yield _event(chunks.usage_chunk())
        except Exception as exc:
            yield _event(error_body("openai", status_of(exc, "openai"), message_of(exc)))
        finally:
            # A client that leaves cancels this generator; the streams still end now (their KV blocks).
            with anyio.CancelScope(shield=True):
                await _close(runs)
            admitted.close()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


async def _close(runs: list[_Run]) -> None:
    """Ends each stream now, so its KV blocks go back at once (a client that left, an error)."""
    for run in runs:
        with contextlib.suppress(Exception):
            await run.deltas.aclose()


def _event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class _Chunks:
    """Builds OpenAI's completion and chat objects (whole, or as stream chunks) from engine deltas."""

    def __init__(self, kind: str, model: str, request_id: str, count: int) -> None:
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.texts = [""] * count
        self.finish: list[str | None] = [None] * count
        self.started = [False] * count
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def add(self, index: int, delta: GenerationDelta) -> None:
        self.texts[index] += delta.text
        if delta.finish_reason is not None:
            self.finish[index] = _FINISH[delta.finish_reason]
            self.prompt_tokens += delta.prompt_tokens
            self.completion_tokens += delta.completion_tokens

    def usage(self) -> dict:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}

    def whole(self) -> dict:
        if self.chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish,
                    "logprobs": None,
                }
                for i, (text, finish) in enumerate(zip(self.texts, self.finish, strict=True))
            ]
            return {**self._head("chat.completion"), "choices": choices, "usage": self.usage()}
        choices = [
            {"index": i, "text": text, "finish_reason": finish, "logprobs": None}
            for i, (text, finish) in enumerate(zip(self.texts, self.finish, strict=True))
        ]
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage()}

    def chunk(self, index: int, delta: GenerationDelta) -> dict:
        self.add(index, delta)
        finish = self.finish[index] if delta.finish_reason is not None else None
        if self.chat:
            content = {"content": delta.text}
            if not self.started[index]:
                content = {"role": "assistant", **content}
                self.started[index] = True
            choice = {"index": index, "delta": content, "finish_reason": finish, "logprobs": None}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta.text, "finish_reason": finish, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage()}


@router.post("/v1/completions", tags=["OpenAI"])
async def completions(request: Request, body: CompletionBody):
    frontend = frontend_of(request)
    engine = engine_named(request, body.model)
    prompts = _prompts(body.prompt)
    if not prompts:
        raise InvalidInput("prompt is empty; send a text, a list of texts or token ids")
    frontend.check_batch(len(prompts), "prompts")
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            frontend.check_chars(prompt, f"prompt[{index}]")
    params = body.sampling(body.max_tokens)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _generate(request, engine, prompts, params, body.stream, "completion", include_usage)


@router.post("/v1/chat/completions", tags=["OpenAI"])
async def chat_completions(request: Request, body: ChatBody):
    frontend = frontend_of(request)
    engine = engine_named(request, body.model)
    if body.response_format not in (None, {"type": "text"}):
        raise InvalidInput('response_format other than {"type": "text"} is not supported by this server')
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = body.sampling(max_tokens)
    prompt = await engine.tokens.chat_prompt(_message_dicts(body, frontend.check_chars))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await _generate(
        request, engine, [prompt], params, body.stream, "chat", include_usage, add_special_tokens=False
    )
