"""The asyncio engine of one served model.

Calls tokenize in a thread pool, split into one scheduler request per input, and wait on futures. A
single loop task asks the scheduler for the next batch and runs it on the model thread; the event loop
stays free meanwhile, so new calls are tokenized and queued while the device works.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from embedserv.config import ModelConfig
from embedserv.engine.loading import LoadedModel, load_model
from embedserv.engine.outputs import finish_embeddings
from embedserv.engine.types import EmbedParams, EmbedResult, ModelInfo, Timing, TokenizedText
from embedserv.errors import InvalidInput, NotReady
from embedserv.scheduler.prefill_only import PrefillOnlyScheduler, PrefillRequest

logger = logging.getLogger(__name__)


def _us(seconds: float) -> int:
    return max(0, int(seconds * 1e6))


class Engine:
    def __init__(
        self, config: ModelConfig, loaded: LoadedModel, model_thread: ThreadPoolExecutor, tokenizer_threads: int = 1
    ) -> None:
        self.config = config
        self.info: ModelInfo = loaded.info
        self.tokenizer = loaded.tokenizer
        self._runner = loaded.runner
        self._scheduler = PrefillOnlyScheduler(config.batch_token_budget, config.max_batch_requests)
        self._futures: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix=f"tokenize-{self.info.name}")
        self._model_thread = model_thread
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None

    @classmethod
    def load(cls, config: ModelConfig, tokenizer_threads: int = 1, warm_up: bool = True) -> Engine:
        """Loads weights and tokenizer (blocking; call it off the event loop) and warms the model up.

        Every torch call of a model runs on its one model thread, loading included: OpenMP keeps a thread
        team per calling thread, and a second team's idle spinning slows the first by 15-30% on 2 cores.
        """
        model_thread = ThreadPoolExecutor(1, thread_name_prefix=f"model-{config.served_name}")
        try:
            loaded = model_thread.submit(load_model, config).result()
            if warm_up:
                model_thread.submit(
                    loaded.runner.warm_up, loaded.info.max_input_tokens, config.batch_token_budget
                ).result()
        except BaseException:
            model_thread.shutdown(wait=False)
            raise
        return cls(config, loaded, model_thread, tokenizer_threads)

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name=f"engine-{self.info.name}")
        self._loop_task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        """A crashed loop must not leave callers waiting forever: fail what is pending."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("engine loop of %s died", self.info.name, exc_info=task.exception())
        self._fail_pending(NotReady(f"model {self.info.name} stopped after an internal error; retry later"))

    def _fail_pending(self, error: Exception) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._futures.clear()

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._fail_pending(NotReady(f"model {self.info.name} is shutting down; retry on another replica"))
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._model_thread.shutdown(wait=True)

    async def embed(self, texts: list[str], params: EmbedParams) -> EmbedResult:
        received = time.perf_counter()
        self._check_params(texts, params)
        loop = asyncio.get_running_loop()
        encoded = await loop.run_in_executor(
            self._tokenizer_pool,
            self.tokenizer.encode_batch,
            texts,
            params.truncate,
            params.truncation_direction,
            params.prompt_name,
        )
        tokenized = time.perf_counter()
        requests = [PrefillRequest(next(self._ids), e.ids, pool_start=e.pool_start) for e in encoded]
        outputs = await self._run_requests(requests)
        rows = np.stack([row for row, _, _ in outputs])
        first_start = min(start for _, start, _ in outputs)
        last_end = max(end for _, _, end in outputs)
        embeddings = finish_embeddings(rows, params.dimensions, params.normalize)
        return EmbedResult(
            embeddings=embeddings,
            prompt_tokens=sum(len(e.ids) for e in encoded),
            timing=Timing(
                queue_us=_us(first_start - tokenized),
                tokenization_us=_us(tokenized - received),
                inference_us=_us(last_end - first_start),
                total_us=_us(time.perf_counter() - received),
            ),
        )

    async def tokenize(
        self, texts: list[str], add_special_tokens: bool, prompt_name: str | None
    ) -> list[TokenizedText]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_pool, self.tokenizer.tokenize, texts, add_special_tokens, prompt_name
        )

    def _check_params(self, texts: list[str], params: EmbedParams) -> None:
        if not texts:
            raise InvalidInput("inputs is empty; send at least one text")
        if params.dimensions is not None and not 1 <= params.dimensions <= self.info.dimension:
            raise InvalidInput(
                f"dimensions must be between 1 and the model's dimension {self.info.dimension}, "
                f"not {params.dimensions}"
            )
        if params.truncation_direction not in ("right", "left"):
            raise InvalidInput(f"truncation_direction must be right or left, not {params.truncation_direction!r}")
        # Unknown prompt names fail before any tokenizing.
        self.tokenizer.resolve_prompt(params.prompt_name)

    async def _run_requests(self, requests: list[PrefillRequest]) -> list[tuple]:
        if not self.is_running:
            raise NotReady(f"model {self.info.name} is not running; retry shortly")
        loop = asyncio.get_running_loop()
        futures = []
        for request in requests:
            future = loop.create_future()
            self._futures[request.request_id] = future
            self._scheduler.add(request)
            futures.append(future)
        self._wakeup.set()
        try:
            return await asyncio.gather(*futures)
        except BaseException:
            # The caller went away (or a batch failed): drop what has not run yet.
            for request, future in zip(requests, futures):
                request.cancelled = True
                self._futures.pop(request.request_id, None)
                future.cancel()
            raise

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._scheduler.schedule()
            if batch is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            started = time.perf_counter()
            try:
                output = await loop.run_in_executor(self._model_thread, self._runner.execute, batch)
            except Exception as exc:
                logger.exception("batch of %d sequences failed on %s", batch.num_sequences, self.info.name)
                for seq in batch.sequences:
                    future = self._futures.pop(seq.request_id, None)
                    if future is not None and not future.done():
                        future.set_exception(RuntimeError(f"inference failed: {exc}"))
                continue
            finished = time.perf_counter()
            logger.debug(
                "%s: batch of %d sequences, %d tokens in %.1f ms",
                self.info.name, batch.num_sequences, batch.num_tokens, (finished - started) * 1e3,
            )
            for request_id, row in zip(output.request_ids, output.pooled):
                future = self._futures.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result((row, started, finished))
