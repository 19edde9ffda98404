"""The asyncio client: `await AsyncClient(target).embed(texts)`; the same calls as Client.

Create it inside the event loop that uses it (`async with AsyncClient(...) as client:`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedserv_client import late_chunks, plans
from embedserv_client.base import ClientSettings
from embedserv_client.images import EmbedImage, ImageLike, embed_items_plan, multi_vector_plan, rerank_images_plan
from embedserv_client.options import RetryPolicy, Tls, time_left
from embedserv_client.streams import AsyncTextStream
from embedserv_client.token_classes import TokenClassification, classify_tokens_plan, token_classify_fields
from embedserv_client.types import (
    Classification,
    EmbedOutputs,
    Limits,
    ModelInfo,
    RerankResult,
    SparseEmbedding,
    Token,
    error_from,
)
from embedserv_client.v1 import embedserv_pb2 as pb
from embedserv_client.v1 import embedserv_pb2_grpc as pb_grpc


class AsyncClient(ClientSettings):
    """The arguments are Client's. `parallel_requests` bounds the requests in flight across all
    split calls of this client."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        api_key: str | None = None,
        tls: bool | Tls = False,
        *,
        model: str = "",
        timeout: float | None = 60.0,
        retry: RetryPolicy | None = None,
        batch_size: int | None = None,
        parallel_requests: int = 4,
        load_balancing: str | None = "round_robin",
        options: Sequence[tuple[str, object]] = (),
        priority: int | None = None,
    ):
        settings = (timeout, retry, batch_size, parallel_requests, load_balancing, options, priority)
        super().__init__(target, api_key, tls, model, *settings)
        args = self.channel_args()
        make = grpc.aio.secure_channel if "credentials" in args else grpc.aio.insecure_channel
        self.channel = make(**args)
        self._stub = pb_grpc.InferenceStub(self.channel)
        self._slots = asyncio.Semaphore(parallel_requests)

    async def embed(
        self,
        texts: str | Sequence[str] = (),
        *,
        images: Sequence[EmbedImage] | None = None,
        model: str | None = None,
        normalize: bool | None = None,
        truncate: bool | None = None,
        truncation_direction: str = "right",
        dimensions: int | None = None,
        prompt_name: str | None = None,
        encoding: str = "float32",
        outputs: Sequence[str] | str | None = None,
        chunking: str | None = None,
        sparse_top_k: int | None = None,
        task: str | None = None,
        bypass_cache: bool = False,
        timeout: float | None = None,
    ) -> np.ndarray | EmbedOutputs:
        items, single = plans.as_list(texts, "texts")
        fields = plans.embed_fields(
            self.model_name(model),
            normalize,
            truncate,
            truncation_direction,
            dimensions,
            prompt_name,
            encoding,
            outputs,
            chunking,
            sparse_top_k,
            task,
            bypass_cache,
        )
        deadline = self.deadline(timeout)
        if images is not None:
            plan = embed_items_plan(items, images, *(await self._image_sizes(deadline)), **fields)
            return await self._run(plan, deadline)
        return await self._run(plans.embed_plan(items, await self._batch_size(deadline), single, **fields), deadline)

    async def embed_chunks(
        self,
        texts: str | Sequence[str],
        *,
        splitter: str = "spans",
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
        chunk_tokens: int = 0,
        overlap_tokens: int = 0,
        model: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        prompt_name: str | None = None,
        encoding: str = "float32",
        task: str | None = None,
        timeout: float | None = None,
    ) -> late_chunks.TextChunks | list[late_chunks.TextChunks]:
        """Late chunking: one vector per chunk of each text, pooled from the whole text's token states. Chunks
        are `spans` (per text, its [start, end) character spans), "sentences", or "tokens" windows of
        `chunk_tokens` sharing `overlap_tokens`. A TextChunks(spans, vectors) per text; for one string, `spans` is
        its own list and one TextChunks comes back."""
        items, single, late, dtype = late_chunks.prepared(
            texts, splitter, spans, chunk_tokens, overlap_tokens, encoding
        )
        fields = plans.embed_fields(
            self.model_name(model), normalize, None, "right", dimensions, prompt_name, encoding, task=task
        )
        deadline = self.deadline(timeout)
        plan = late_chunks.embed_chunks_plan(items, await self._batch_size(deadline), single, late, dtype, **fields)
        return await self._run(plan, deadline)

    async def rerank(
        self,
        query: str,
        documents: Sequence[str] = (),
        *,
        document_images: Sequence[ImageLike | tuple[ImageLike, str]] | None = None,
        query_image: ImageLike | None = None,
        top_n: int | None = None,
        return_documents: bool = False,
        raw_scores: bool = False,
        truncate: bool | None = None,
        instruction: str = "",
        chunking: str | None = None,
        model: str | None = None,
        timeout: float | None = None,
    ) -> list[RerankResult]:
        plans.string(query, "query")
        items, _ = plans.as_list(documents, "documents")
        fields = self.rerank_fields(model, return_documents, raw_scores, truncate, instruction, chunking)
        deadline = self.deadline(timeout)
        if document_images is not None or query_image is not None:
            sizes = await self._image_sizes(deadline)
            plan = rerank_images_plan(query, items, document_images, query_image, *sizes, top_n, **fields)
            return await self._run(plan, deadline)
        size = await self._batch_size(deadline)
        return await self._run(plans.rerank_plan(query, items, size, top_n, **fields), deadline)

    async def embed_sparse(
        self,
        texts: str | Sequence[str],
        *,
        top_k: int | None = None,
        truncate: bool | None = None,
        truncation_direction: str = "right",
        prompt_name: str | None = None,
        model: str | None = None,
        timeout: float | None = None,
    ) -> SparseEmbedding | list[SparseEmbedding]:
        items, single = plans.as_list(texts, "texts")
        fields = self.sparse_fields(model, top_k, truncate, truncation_direction, prompt_name)
        deadline = self.deadline(timeout)
        size = await self._batch_size(deadline)
        return await self._run(plans.embed_sparse_plan(items, size, single, **fields), deadline)

    async def embed_multi_vector(
        self,
        texts: str | Sequence[str] = (),
        *,
        images: Sequence[ImageLike] | None = None,
        prompt_name: str | None = None,
        truncate: bool | None = None,
        model: str | None = None,
        timeout: float | None = None,
    ) -> np.ndarray | list[np.ndarray]:
        items, single = plans.as_list(texts, "texts")
        fields = self.multi_vector_fields(model, truncate, prompt_name)
        deadline = self.deadline(timeout)
        if images is not None:
            plan = multi_vector_plan(items, images, *(await self._image_sizes(deadline)), **fields)
            return await self._run(plan, deadline)
        size = await self._batch_size(deadline)
        return await self._run(plans.embed_multi_vector_plan(items, size, single, **fields), deadline)

    async def classify(
        self,
        texts: str | Sequence[str],
        *,
        raw_scores: bool = False,
        truncate: bool | None = None,
        truncation_direction: str = "right",
        candidate_labels: Sequence[str] | str | None = None,
        hypothesis_template: str = "",
        multi_label: bool = False,
        model: str | None = None,
        timeout: float | None = None,
    ) -> Classification | list[Classification]:
        items, single = plans.as_list(texts, "texts")
        fields = self.classify_fields(
            model, raw_scores, truncate, truncation_direction, candidate_labels, hypothesis_template, multi_label
        )
        deadline = self.deadline(timeout)
        size = await self._batch_size(deadline)
        return await self._run(plans.classify_plan(items, size, single, **fields), deadline)

    async def classify_tokens(
        self,
        texts: str | Sequence[str],
        *,
        aggregation: str = "none",
        ignore_labels: Sequence[str] | None = None,
        all_scores: bool = False,
        truncate: bool | None = None,
        truncation_direction: str = "right",
        model: str | None = None,
        timeout: float | None = None,
    ) -> TokenClassification | list[TokenClassification]:
        items, single = plans.as_list(texts, "texts")
        fields = token_classify_fields(
            self.model_name(model), aggregation, ignore_labels, all_scores, truncate, truncation_direction
        )
        deadline = self.deadline(timeout)
        size = await self._batch_size(deadline)
        return await self._run(classify_tokens_plan(items, size, single, **fields), deadline)

    async def tokenize(
        self,
        texts: str | Sequence[str],
        *,
        add_special_tokens: bool = True,
        prompt_name: str | None = None,
        model: str | None = None,
        timeout: float | None = None,
    ) -> list[Token] | list[list[Token]]:
        items, single = plans.as_list(texts, "texts")
        fields = self.tokenize_fields(model, add_special_tokens, prompt_name)
        deadline = self.deadline(timeout)
        size = await self._batch_size(deadline)
        return await self._run(plans.tokenize_plan(items, size, single, **fields), deadline)

    def generate(
        self,
        prompt: str,
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        ignore_eos: bool = False,
        decoder_prompt: str = "",
        model: str | None = None,
        timeout: float | None = None,
    ) -> AsyncTextStream:
        """`async for text in client.generate(...)` (no await before it)."""
        request = plans.generate_request(
            prompt,
            self.model_name(model),
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop,
            ignore_eos,
            decoder_prompt,
        )
        return AsyncTextStream(
            lambda left: self._stub.Generate(request, timeout=left, metadata=self.metadata),
            self.retry,
            self.deadline(timeout),
        )

    def embed_stream(
        self,
        batches: Iterable[Sequence[str]] | AsyncIterable[Sequence[str]],
        *,
        timeout: float | None = None,
        **params,
    ) -> AsyncIterator[np.ndarray]:
        """As Client.embed_stream (`async for`, no await); `batches` may be an async iterable."""
        checked = plans.StreamRequests(self.stream_fields(params))

        async def requests():
            index = 0
            if isinstance(batches, AsyncIterable):
                async for batch in batches:
                    yield checked.request(index, batch)
                    index += 1
            else:
                for index, batch in enumerate(batches):
                    yield checked.request(index, batch)

        call = self._stub.EmbedStream(requests(), timeout=time_left(self.deadline(timeout)), metadata=self.metadata)
        return self._stream_matrices(call, checked)

    @staticmethod
    async def _stream_matrices(call, checked: plans.StreamRequests) -> AsyncIterator[np.ndarray]:
        try:
            async for reply in call:
                yield plans.embedding_matrix([reply], checked.fields["encoding"])
        except asyncio.CancelledError:
            # grpc.aio cancels the call when its request iterator raises.
            if checked.error is not None:
                raise checked.error from None
            raise
        except grpc.RpcError as err:
            if checked.error is not None:
                raise checked.error from None
            raise error_from(err) from None
        finally:
            call.cancel()

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        reply = await self._list_models(self.deadline(timeout))
        return [ModelInfo.from_proto(m) for m in reply.models]

    async def limits(self, *, timeout: float | None = None) -> Limits:
        return await self._known_limits(self.deadline(timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), self.deadline(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # --- plumbing ---------------------------------------------------------------------------------

    async def _list_models(self, deadline: float | None) -> pb.ListModelsResponse:
        return await self._call(self._stub.ListModels, pb.ListModelsRequest(), deadline)

    async def _known_limits(self, deadline: float | None) -> Limits:
        if self._limits is None:
            self._limits = Limits.from_proto((await self._list_models(deadline)).limits)
        return self._limits

    async def _batch_size(self, deadline: float | None) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return self.server_batch_size(await self._known_limits(deadline))

    async def _image_sizes(self, deadline: float | None) -> tuple[int, int]:
        return self.image_sizes(await self._batch_size(deadline), await self._known_limits(deadline))

    async def _call(self, method, request, deadline: float | None):
        attempt = 0
        while True:
            attempt += 1
            try:
                return await method(request, timeout=time_left(deadline), metadata=self.metadata)
            except grpc.RpcError as err:
                delay = self.retry.delay(err.code(), attempt, deadline)
                if delay is None:
                    raise error_from(err) from None
            await asyncio.sleep(delay)

    async def _bounded_call(self, method, request, deadline: float | None, gate: asyncio.Semaphore):
        async with gate, self._slots:
            return await self._call(method, request, deadline)

    async def _run(self, plan: plans.Plan, deadline: float | None):
        method = getattr(self._stub, plan.method)
        if len(plan.requests) == 1:
            return plan.merge([await self._call(method, plan.requests[0], deadline)])
        gate = asyncio.Semaphore(self.requests_in_flight(plan))
        tasks = [asyncio.ensure_future(self._bounded_call(method, r, deadline, gate)) for r in plan.requests]
        try:
            return plan.merge(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
