"""The generation side of an Engine, one per worker: continuous batching over that worker's paged KV
cache, streamed text.

`generate()` checks and tokenizes the prompt (prompts.py) and queues it here; the dispatcher (dispatch.py,
shared with the model's prefill-only work) runs the worker's steps one at a time, and step_done turns
the sampled tokens into text deltas in the tokenizer pool and decides who is done (max_tokens, a stop
string, EOS). A stream that ends for any reason, the client's cancel or deadline included, returns its
KV blocks before the next step is scheduled.

A stream lives in its worker's KV cache, so when that worker dies its streams fail with NotReady
(UNAVAILABLE); the scheduler starts over with an empty cache once the replacement is ready.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace

from embedserv import metrics
from embedserv.call_class import stamp
from embedserv.engine.core.detokenizer import IncrementalDetokenizer
from embedserv.engine.core.dispatch import Step
from embedserv.engine.core.prompts import PreparedPrompt
from embedserv.engine.inputs.tokenizer import TokenizerPool
from embedserv.errors import InvalidInput, NotReady
from embedserv.executor.base import Worker, WorkerDied
from embedserv.scheduler.generation import GenerationScheduler
from embedserv.scheduler.kv_cache_manager import KvCacheManager
from embedserv.scheduler.request import Request, RequestStatus
from embedserv.scheduler.waiting import DEFAULT_POLICY, PriorityPolicy
from embedserv.steps import OutputKind, StepOutput
from embedserv.types import FinishReason, GenerationDelta, KvCacheUsage, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    request: Request
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    # An error taken off the queue behind deltas that were joined (see _catch_up): raised next.
    error: Exception | None = None
    # For a caller that takes the generation whole (stream=False): the deltas so far, joined with the last one
    # when it comes. None: each delta is queued as it comes.
    held: list[GenerationDelta] | None = None


# A step's new text for up to this many streams is made on the event loop: about 1 ms (0.86 ms at 128 on a 2-core
# AVX2 EPYC, benchmarks/generation_host.py), less than the hand-off to the tokenizer thread and back costs under
# load in GIL waits and wake-ups, and no prompt being tokenized there holds the step up.
_INLINE_DETOKENIZE = 128


class GenerationStreams:
    """One worker's streams and the scheduler over its KV cache: a StepSource (dispatch.py) of that worker
    alone, one step at a time (a step's sampled tokens are the next step's input)."""

    one_step_at_a_time = True

    def __init__(
        self,
        name: str,
        worker: Worker,
        tokenizer_pool: TokenizerPool,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        max_batch_tokens: int,
        max_num_seqs: int,
        enable_prefix_caching: bool,
        wake: Callable[[], None],
        policy: PriorityPolicy = DEFAULT_POLICY,
    ) -> None:
        """`wake`: the dispatcher's, called when there is new work; `policy`: how queued streams are ordered."""
        self.name = name
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.worker = worker
        self._budgets = (max_batch_tokens, max_num_seqs)
        self._enable_prefix_caching = enable_prefix_caching
        self._policy = policy
        # Built for each worker process once it is ready (its KV cache), see _reset.
        self.kv_cache: KvCacheManager | None = None
        self.scheduler: GenerationScheduler | None = None
        # True from start() to stop() (or the dispatcher's crash).
        self.running = False
        self._incarnation = 0
        # Counters of the schedulers of earlier worker processes.
        self._past_preemptions = 0
        self._past_cached_tokens = 0
        # Streams whose caller went away while they waited for their first step: never computed.
        self.num_dropped = 0
        self._tokenizer_pool = tokenizer_pool
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._wake = wake

    def start(self) -> None:
        self.running = True
        self.follow_worker()

    def stop(self) -> None:
        """The engine stops: every stream ends (CANCELLED)."""
        self.running = False
        self.end_all(FinishReason.CANCELLED)

    @property
    def is_accepting(self) -> bool:
        """Running on a ready worker whose KV cache this scheduler tracks, and which is not to be replaced."""
        ready = self.worker.ready and not self.worker.recycling
        return self.running and ready and self._incarnation == self.worker.incarnation

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def is_idle(self) -> bool:
        """No stream on this worker: it may be replaced (past its memory ceiling) without ending one."""
        return not self._streams

    @property
    def num_waiting(self) -> int:
        """Streams not yet admitted to a step (none before the first worker is ready)."""
        return self.scheduler.num_waiting if self.scheduler is not None else 0

    def kv_cache_usage(self) -> KvCacheUsage:
        kv_cache, scheduler = self.kv_cache, self.scheduler
        return KvCacheUsage(
            block_size=kv_cache.block_size if kv_cache is not None else 0,
            total_blocks=kv_cache.num_blocks if kv_cache is not None else 0,
            used_blocks=kv_cache.num_used_blocks if kv_cache is not None else 0,
            preemptions=self._past_preemptions + (scheduler.num_preemptions if scheduler is not None else 0),
            cached_prompt_tokens=self._past_cached_tokens + (scheduler.num_cached_tokens if scheduler else 0),
        )

    def _reset(self) -> None:
        """A new, empty KV cache: a fresh scheduler sized to the worker's cache. No stream is left: they failed
        when the worker went down, and none is accepted until this reset."""
        if self.scheduler is not None:
            self._past_preemptions += self.scheduler.num_preemptions
            self._past_cached_tokens += self.scheduler.num_cached_tokens
        layout = self.worker.kv_cache
        if layout is None:
            raise NotReady(f"worker {self.worker.index} of model {self.name} has no KV cache yet")
        self.kv_cache = KvCacheManager(list(layout.groups), layout.num_blocks, self._enable_prefix_caching)
        self.scheduler = GenerationScheduler(self.kv_cache, *self._budgets, self._policy.max_wait_s)
        self._incarnation = self.worker.incarnation

    def workers_changed(self) -> None:
        """A dead worker's streams fail at once, even between steps; a new one is followed at once."""
        if not self.worker.ready:
            self._fail_streams(self._worker_gone())
        elif self.running:
            self.follow_worker()

    def _worker_gone(self) -> NotReady:
        return NotReady(
            f"worker {self.worker.index} of model {self.name} stopped; its streams cannot resume, retry the call"
        )

    def follow_worker(self) -> None:
        """A new, ready worker process gets a fresh scheduler over its empty cache (streams of the old one
        have failed)."""
        if self.worker.ready and self._incarnation != self.worker.incarnation:
            self._fail_streams(self._worker_gone())
            self._reset()

    def _live(self) -> tuple[KvCacheManager, GenerationScheduler]:
        """The current worker process's cache and scheduler (built once it is ready, see _reset)."""
        if self.kv_cache is None or self.scheduler is None:
            raise NotReady(f"worker {self.worker.index} of model {self.name} is not ready yet; retry shortly")
        return self.kv_cache, self.scheduler

    def schedule(self) -> Step | None:
        """The next step; call on a ready worker only."""
        self.follow_worker()
        batch = self._live()[1].schedule()
        return Step(batch, generation=True) if batch is not None else None

    async def stream(
        self, prompt: PreparedPrompt, params: SamplingParams, whole: bool = False
    ) -> AsyncGenerator[GenerationDelta, None]:
        """Runs a tokenized prompt (prompts.py) on this worker; yields its deltas. `whole`: one delta
        at the end, all the text and tokens in it; the caller is not woken at each step."""
        if not self.is_accepting:
            raise NotReady(f"worker {self.worker.index} of model {self.name} is not running; retry shortly")
        request = Request(
            next(self._ids),
            prompt.token_ids,
            OutputKind.SAMPLE,
            sampling=params,
            encoder_token_ids=prompt.encoder_token_ids,
        )
        stamp(request, self._policy.default_priority)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self._room(request)
            params = replace(params, max_tokens=max_tokens)
            request.sampling = params
        self._check_fits(request, max_tokens)
        stream = _Stream(request, params, prompt.detokenizer, held=[] if whole else None)
        self._streams[request.request_id] = stream
        self._live()[1].add(request)
        self._wake()
        try:
            while True:
                item = stream.error or await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                item = _catch_up(stream, item)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Also when the caller stops listening (client cancel, deadline): the blocks go back now.
            if not stream.finished and request.status is RequestStatus.WAITING and not request.num_preemptions:
                self.num_dropped += 1
            self._forget(stream)

    def _room(self, request: Request) -> int:
        """Tokens a request may generate when it sets no max_tokens: up to the model's context or what one
        stream can hold of the KV cache, whichever is less (at least 1, so that _check_fits explains)."""
        kv_cache = self._live()[0]
        capacity = kv_cache.managers[0].num_blocks * kv_cache.block_size
        return max(1, min(self.max_model_len, capacity) - len(request.prompt_token_ids))

    def _check_fits(self, request: Request, max_tokens: int) -> None:
        prompt_tokens = len(request.prompt_token_ids)
        total = prompt_tokens + max_tokens
        limit = self.max_model_len
        if total > limit:
            raise InvalidInput(
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} make {total}, more than the "
                f"model's context of {limit} tokens; shorten the prompt or lower max_tokens"
            )
        kv_cache, scheduler = self._live()
        if not scheduler.can_ever_fit(request, total):
            capacity = kv_cache.managers[0].num_blocks * kv_cache.block_size
            raise InvalidInput(
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} need more than this server's "
                f"KV cache of {capacity} tokens; lower max_tokens or shorten the prompt"
            )

    def _forget(self, stream: _Stream) -> None:
        self._streams.pop(stream.request.request_id, None)
        if self.scheduler is not None:
            self.scheduler.finish(stream.request.request_id)
        stream.finished = True

    def _close(self, stream: _Stream, item) -> None:
        if not stream.finished:
            if stream.held and isinstance(item, GenerationDelta):
                item = _joined([*stream.held, item])
            stream.queue.put_nowait(item)
        self._forget(stream)

    def end_all(self, reason: FinishReason) -> None:
        for stream in list(self._streams.values()):
            request = stream.request
            self._close(stream, GenerationDelta("", (), reason, _prompt_tokens(request), len(request.output_token_ids)))

    def fail_all(self, error: Exception) -> None:
        """The dispatcher crashed: every stream fails, and no new one is taken."""
        self.running = False
        self._fail_streams(error)

    def _fail_streams(self, error: Exception) -> None:
        for stream in list(self._streams.values()):
            self._close(stream, error)

    async def step_done(self, step: Step, output: StepOutput, worker: Worker, started: float) -> None:
        batch = step.batch
        metrics.BATCH_SEQUENCES.labels(self.name, "generate").observe(batch.num_sequences)
        metrics.BATCH_TOKENS.labels(self.name, "generate").observe(batch.num_tokens)
        sampled = output.sampled()
        self._live()[1].update(batch, sampled)
        live = {rid: token for rid, token in sampled.items() if rid in self._streams}
        # On the loop up to _INLINE_DETOKENIZE streams, as short inputs are tokenized (engine/inputs/tokenizer.py).
        inline = 0 if len(live) <= _INLINE_DETOKENIZE else None
        deltas = await self._tokenizer_pool.run(self._detokenize, (live,), inline)
        for request_id, delta in deltas:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if delta.finish_reason is not None:
                self._close(stream, delta)
            elif stream.held is not None:
                stream.held.append(delta)
            else:
                stream.queue.put_nowait(delta)

    def step_failed(self, step: Step, exc: Exception) -> None:
        logger.error("generation step of %d sequences failed on %s", step.batch.num_sequences, self.name, exc_info=exc)
        for chunk in step.batch.sequences:
            stream = self._streams.get(chunk.request_id)
            if stream is not None:
                self._close(stream, RuntimeError(f"generation failed: {exc}"))

    def worker_died(self, step: Step, died: WorkerDied) -> None:
        logger.error("%s: %s; failing its %d streams", self.name, died, len(self._streams))
        self._fail_streams(NotReady(f"{died}; the generation cannot go on elsewhere, retry the call"))

    def _detokenize(self, sampled: dict[int, int]) -> list[tuple[int, GenerationDelta]]:
        """New text and the finish decision of every request that got a token (tokenizer thread)."""
        out = []
        for request_id, token in sampled.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            out.append((request_id, self._next_delta(stream, token)))
        return out

    def _next_delta(self, stream: _Stream, token: int) -> GenerationDelta:
        request, params, detokenizer = stream.request, stream.params, stream.detokenizer
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        text = "" if is_eos else detokenizer.add(token)
        if detokenizer.stopped:
            reason = FinishReason.STOP
        elif is_eos:
            reason = FinishReason.EOS
        elif len(request.output_token_ids) >= request.max_tokens:
            reason = FinishReason.LENGTH
        else:
            return GenerationDelta(text, (token,))
        if reason is not FinishReason.STOP:
            text += detokenizer.flush()
        return GenerationDelta(text, (token,), reason, _prompt_tokens(request), len(request.output_token_ids))


def _catch_up(stream: _Stream, delta: GenerationDelta) -> GenerationDelta:
    """`delta` joined with the deltas queued behind it: a caller that fell behind (a slow client, a busy event
    loop) gets one message for several steps instead of one per step. An error behind them comes next."""
    deltas = [delta]
    while deltas[-1].finish_reason is None and not stream.queue.empty():
        item = stream.queue.get_nowait()
        if isinstance(item, Exception):
            stream.error = item
            break
        deltas.append(item)
    return _joined(deltas)


def _joined(deltas: list[GenerationDelta]) -> GenerationDelta:
    """The last delta with the text and tokens of them all."""
    if len(deltas) == 1:
        return deltas[0]
    text, tokens = "".join(d.text for d in deltas), tuple(t for d in deltas for t in d.token_ids)
    return replace(deltas[-1], text=text, token_ids=tokens)


def _prompt_tokens(request: Request) -> int:
    """Usage: every prompt token the model read, the encoder's and the decoder's (its start token included)."""
    return len(request.prompt_token_ids) + request.num_encoder_tokens
