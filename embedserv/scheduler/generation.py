"""Continuous batching for generation: one token budget per step shared by decodes and chunked prefills.

Running requests go first, in admission order; when the KV cache is full the latest admitted request
is preempted and later recomputed from scratch (prompt + outputs so far); running streams are never preempted
for priority, only their order in the waiting queue is. An encoder-decoder request's
encoder runs in its first step after each admission, which writes its cross KV (a fixed block table);
its decoder tokens are what the budget counts. Waiting requests are admitted
in WaitingQueue's order (priority, tenants in turn, aged first) with whatever budget is left. No torch here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from embedserv.scheduler.kv_cache_manager import KvCacheManager
from embedserv.scheduler.request import Request, RequestStatus
from embedserv.scheduler.waiting import WaitingQueue
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch


class GenerationScheduler:
    """Picks each step's chunks; update() records what the runner computed and sampled.

    The engine decides when a request is done (max_tokens, stop tokens, cancel) and calls finish().
    """

    def __init__(
        self, kv_cache: KvCacheManager, max_batch_tokens: int, max_num_seqs: int, max_wait_s: float | None = None
    ) -> None:
        """`max_wait_s`: the waiting queue's aging bound (WaitingQueue)."""
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_batch_tokens and max_num_seqs must be at least 1")
        self.kv_cache = kv_cache
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.num_preemptions = 0
        # Tokens admitted requests did not compute because their prompt's blocks were cached.
        self.num_cached_tokens = 0
        self._waiting = WaitingQueue(max_wait_s)
        # Admission order: the last one is the first to be preempted.
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting_tokens(self) -> int:
        """Tokens the waiting requests would compute on admission (a preempted one recomputes its outputs too)."""
        # Iterating takes a snapshot, so another thread may read this while the loop schedules.
        return sum(r.num_tokens + r.num_encoder_tokens for r in self._waiting)

    def waiting_counts(self) -> dict[tuple[int, str], int]:
        """Waiting requests per (priority, tenant) (safe from another thread)."""
        return self._waiting.counts()

    def running_counts(self) -> Counter[tuple[int, str]]:
        """Running requests per (priority, tenant) (safe from another thread)."""
        return Counter((r.priority, r.tenant) for r in tuple(self._running))

    def can_ever_fit(self, request: Request, num_tokens: int) -> bool:
        return self.kv_cache.can_ever_fit(request, num_tokens)

    def add(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already scheduled")
        if request.status is not RequestStatus.WAITING or request.block_ids or request.num_computed_tokens:
            raise ValueError("only a fresh request can be added")
        if not request.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if request.output is not OutputKind.SAMPLE or request.sampling is None:
            raise ValueError("a generation request samples and needs its sampling params")
        self._requests[request.request_id] = request
        self._waiting.append(request)

    def finish(self, request_id: int) -> None:
        """Removes a finished or aborted request and frees its blocks. Unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED

    def schedule(self) -> StepBatch | None:
        """The next step's chunks, or None when nothing can run."""
        chunks: list[ScheduledSequence] = []
        preemptions_before = self.num_preemptions
        budget = self._schedule_running(chunks)
        # After a preemption the cache is short: admitting new work would only thrash it.
        if self.num_preemptions == preemptions_before:
            self._schedule_waiting(chunks, budget)
        return StepBatch(sequences=tuple(chunks)) if chunks else None

    def update(self, batch: StepBatch, sampled: Mapping[int, int]) -> None:
        """Advances the requests `batch` computed and appends their sampled tokens.

        Chunks of requests finished since schedule() are ignored.
        """
        block_size = self.kv_cache.block_size
        for chunk in batch.sequences:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != chunk.start_position:
                raise RuntimeError("update() must be called exactly once after each schedule()")
            full_blocks_before = request.num_computed_tokens // block_size
            request.num_computed_tokens += len(chunk.token_ids)
            token = sampled.get(chunk.request_id)
            if token is not None:
                if not chunk.produces_output:
                    raise ValueError(f"request {chunk.request_id} was sampled mid-prefill")
                request.output_token_ids.append(token)
            # Hash only when a block boundary was crossed: all_token_ids() copies the sequence.
            if request.num_computed_tokens // block_size > full_blocks_before:
                self.kv_cache.register_full_blocks(request)

    def _schedule_running(self, chunks: list[ScheduledSequence]) -> int:
        """Schedules running requests in admission order; returns the budget left."""
        budget = self.max_batch_tokens
        index = 0
        while index < len(self._running) and budget > 0 and len(chunks) < self.max_num_seqs:
            request = self._running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            if not self._grow_or_preempt(request, request.num_computed_tokens + num_new):
                break
            chunks.append(self._make_chunk(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _grow_or_preempt(self, request: Request, num_tokens: int) -> bool:
        """Grows the table to `num_tokens`, preempting the latest admitted requests until it fits.

        False when `request` itself was the latest and got preempted.
        """
        if self.kv_cache.covers(request, num_tokens):
            return True
        # Requests before `request` are already in this step's batch; the victims all come after it.
        while not self.kv_cache.can_allocate(request, num_tokens):
            victim = self._running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        self.kv_cache.allocate(request, num_tokens)
        return True

    def _preempt(self, request: Request) -> None:
        # Recompute rather than swap: the KV is dropped and prompt + outputs run again later.
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Victims go latest-first, so pushing each to the front keeps the earliest admitted first.
        self._waiting.appendleft(request)

    def _schedule_waiting(self, chunks: list[ScheduledSequence], budget: int) -> None:
        """Admits waiting requests in the queue's order (priority, then arrival) while budget, sequences and
        blocks last."""
        while budget > 0 and len(self._running) < self.max_num_seqs:
            request = self._waiting.first()
            if request is None:
                return
            num_new = self._admit(request, budget)
            if num_new == 0:
                return
            self._waiting.pop(request)
            self._running.append(request)
            chunks.append(self._make_chunk(request, num_new))
            budget -= num_new

    def _admit(self, request: Request, budget: int) -> int:
        """Gives a waiting request its cached prefix and blocks.

        Returns the number of tokens to compute this step; 0 (and nothing held) when blocks are short.
        """
        kv_cache = self.kv_cache
        num_cached = 0
        if kv_cache.enable_prefix_caching:
            # Leave at least the last token to compute so the step samples; matching only blocks
            # before it also means a shared cached block is never written again.
            leading = request.token_ids_between(0, request.num_tokens - 1)
            num_cached = kv_cache.allocate_cached_prefix(request, leading)
        num_new = min(request.num_tokens - num_cached, budget)
        if not kv_cache.can_allocate(request, num_cached + num_new):
            kv_cache.free(request)
            return 0
        kv_cache.allocate(request, num_cached + num_new)
        request.num_computed_tokens = num_cached
        self.num_cached_tokens += num_cached
        request.status = RequestStatus.RUNNING
        request.encoder_pending = bool(request.encoder_token_ids)
        return num_new

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        end = start + num_new
        samples = end == request.num_tokens
        encoder_ids = tuple(request.encoder_token_ids) if request.encoder_pending else ()
        request.encoder_pending = False
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids_between(start, end)),
            output=OutputKind.SAMPLE,
            start_position=start,
            block_ids=tuple(tuple(table) for table in request.block_ids),
            produces_output=samples,
            # Also on chunks that do not sample: a worker keeps it from a request's first chunk (step deltas).
            sampling=request.sampling,
            encoder_token_ids=encoder_ids,
            encoder_len=request.num_encoder_tokens,
        )
