"""The blocking client: `Client(target).embed(texts) -> numpy.ndarray`, and the other RPCs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from embedserv_client import late_chunks, plans
from embedserv_client.base import ClientSettings
from embedserv_client.images import EmbedImage, ImageLike, embed_items_plan, multi_vector_plan, rerank_images_plan
from embedserv_client.options import RetryPolicy, Tls, time_left
from embedserv_client.streams import TextStream, stream_matrices
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


class Client(ClientSettings):
    """A blocking embedserv client; safe to share between threads. Use it as a context manager or close().

    `target`: "host:port", or "dns:///name:port" for the replicas behind a headless Service (calls are
    spread round robin). `api_key`: sent as `authorization: Bearer KEY`. `tls`: True (system roots) or
    a Tls. `model`: the served model the calls name unless a call names its own. `timeout`: seconds
    per call, retries included. `batch_size`: inputs per request; None asks the server (ListModels'
    limits) once. `parallel_requests`: how many requests of split calls are in flight at once.
    `load_balancing`: the gRPC policy over the addresses the target resolves to (None: gRPC's default,
    pick_first). `options`: more gRPC channel arguments, e.g. ("grpc.dns_min_time_between_resolutions_ms",
    5000) to look for new replicas sooner than gRPC's 30 s. `priority`: every call's (higher runs sooner).
    """

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
        make = grpc.secure_channel if "credentials" in args else grpc.insecure_channel
        self.channel = make(**args)
        self._stub = pb_grpc.InferenceStub(self.channel)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # --- the RPCs ---------------------------------------------------------------------------------

    def embed(
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
        """Embeddings: [len(texts), dimension], or [dimension] for one string, float32 unless `encoding` says
        "float16", "int8" / "uint8" (codes whose raw integer dot products rank as the floats do: for vector
        databases), "int8_per_dimension" / "uint8_per_dimension" (sentence-transformers' per-dimension buckets)
        or "binary" / "ubinary" (packed bits, int8 / uint8, [n, ceil(dimension / 8)]). `chunking="mean"` embeds
        inputs past the model's limit by windows. `outputs` (some of "dense", "sparse", "multi_vector", from one
        forward pass) returns an EmbedOutputs instead, with the int8 / uint8 `encoding_scale`; `sparse_top_k`
        keeps the largest values of the sparse output. `task` picks the model's task adapter (ListModels'
        adapters, e.g. "retrieval.query") and that task's prompt. `bypass_cache` neither reads nor fills the
        server's embedding cache (--embedding-cache). `images` (encoded PNG / JPEG / WebP bytes, or file
        paths; an (image, text) pair embeds the image with its text, one vector, and an Interleaved input texts
        and images in its order, several images included, on the vision-language embedders) for models whose
        ModelInfo.modalities include "image": their rows follow the texts' rows, and the result is a matrix (or
        EmbedOutputs) even for one string."""
        items, single = plans.as_list(texts, "texts")
        options = (normalize, truncate, truncation_direction, dimensions, prompt_name, encoding, outputs, chunking)
        fields = plans.embed_fields(self.model_name(model), *options, sparse_top_k, task, bypass_cache)
        deadline = self.deadline(timeout)
        if images is not None:
            plan = embed_items_plan(items, images, *(self._image_sizes(deadline)), **fields)
            return self._run(plan, deadline)
        return self._run(plans.embed_plan(items, self._batch_size(deadline), single, **fields), deadline)

    def embed_chunks(
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
        plan = late_chunks.embed_chunks_plan(items, self._batch_size(deadline), single, late, dtype, **fields)
        return self._run(plan, deadline)

    def rerank(
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
        """The documents scored against the query, best first (the best `top_n` if given). `chunking="max"`
        scores a document that does not fit beside the query by its best window. `document_images` (bytes or file
        paths; an (image, text) pair for an image with text after it) instead of `documents`: for models that take
        images (ColPali-style, dual encoders, Qwen3-VL rerankers); results carry no document. `query_image`: the
        query is this image with `query` as its text after it (Qwen3-VL rerankers, text documents)."""
        plans.string(query, "query")
        items, _ = plans.as_list(documents, "documents")
        fields = self.rerank_fields(model, return_documents, raw_scores, truncate, instruction, chunking)
        deadline = self.deadline(timeout)
        if document_images is not None or query_image is not None:
            sizes = self._image_sizes(deadline)
            plan = rerank_images_plan(query, items, document_images, query_image, *sizes, top_n, **fields)
            return self._run(plan, deadline)
        return self._run(plans.rerank_plan(query, items, self._batch_size(deadline), top_n, **fields), deadline)

    def embed_sparse(
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
        """Sparse vectors over the vocabulary (models with the sparse output): a SparseEmbedding(indices,
        values) per text, or one for one string; `top_k` keeps each text's largest values."""
        items, single = plans.as_list(texts, "texts")
        fields = self.sparse_fields(model, top_k, truncate, truncation_direction, prompt_name)
        deadline = self.deadline(timeout)
        return self._run(plans.embed_sparse_plan(items, self._batch_size(deadline), single, **fields), deadline)

    def embed_multi_vector(
        self,
        texts: str | Sequence[str] = (),
        *,
        images: Sequence[ImageLike] | None = None,
        prompt_name: str | None = None,
        truncate: bool | None = None,
        model: str | None = None,
        timeout: float | None = None,
    ) -> np.ndarray | list[np.ndarray]:
        """Token vectors: a [num_vectors, dim] float32 array per text, or one for one string. `prompt_name`:
        "query" or "document" for late-interaction models, else the model's own prompt names. `images` (bytes or
        file paths; page images for ColPali-style models): their arrays follow the texts', and a list comes back."""
        items, single = plans.as_list(texts, "texts")
        fields = self.multi_vector_fields(model, truncate, prompt_name)
        deadline = self.deadline(timeout)
        if images is not None:
            plan = multi_vector_plan(items, images, *(self._image_sizes(deadline)), **fields)
            return self._run(plan, deadline)
        plan = plans.embed_multi_vector_plan(items, self._batch_size(deadline), single, **fields)
        return self._run(plan, deadline)

    def classify(
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
        """One Classification per text (one, not a list, for one string).

        `candidate_labels` (an NLI model): zero-shot classification into these labels, in this order, with
        each label put into `hypothesis_template` (default "This example is {}."); `multi_label` scores
        each label on its own instead of a softmax across them."""
        items, single = plans.as_list(texts, "texts")
        fields = self.classify_fields(
            model, raw_scores, truncate, truncation_direction, candidate_labels, hypothesis_template, multi_label
        )
        deadline = self.deadline(timeout)
        return self._run(plans.classify_plan(items, self._batch_size(deadline), single, **fields), deadline)

    def classify_tokens(
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
        """Each text's tokens and entities (one, not a list, for one string), grouped as transformers'
        token-classification pipeline's aggregation_strategy `aggregation`; `ignore_labels` None: ["O"]."""
        items, single = plans.as_list(texts, "texts")
        fields = token_classify_fields(
            self.model_name(model), aggregation, ignore_labels, all_scores, truncate, truncation_direction
        )
        deadline = self.deadline(timeout)
        return self._run(classify_tokens_plan(items, self._batch_size(deadline), single, **fields), deadline)

    def tokenize(
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
        return self._run(plans.tokenize_plan(items, self._batch_size(deadline), single, **fields), deadline)

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
    ) -> TextStream:
        """An iterator of text deltas; `.finish_reason` and `.usage` are set once it ends."""
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
        return TextStream(
            lambda left: self._stub.Generate(request, timeout=left, metadata=self.metadata),
            self.retry,
            self.deadline(timeout),
        )

    def embed_stream(
        self, batches: Iterable[Sequence[str]], *, timeout: float | None = None, **params
    ) -> Iterator[np.ndarray]:
        """One EmbedStream call: a matrix per batch, in order. Batches are sent as given (each must fit
        the server's batch limit) and the stream is not retried. `params` as for embed()."""
        checked = plans.StreamRequests(self.stream_fields(params))
        requests = (checked.request(index, batch) for index, batch in enumerate(batches))
        replies = self._stub.EmbedStream(requests, timeout=time_left(self.deadline(timeout)), metadata=self.metadata)
        return stream_matrices(replies, checked)

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return [ModelInfo.from_proto(m) for m in self._list_models(self.deadline(timeout)).models]

    def limits(self, *, timeout: float | None = None) -> Limits:
        """The server's limits (ListModels), asked once and remembered."""
        return self._known_limits(self.deadline(timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The health status name ("SERVING", "NOT_SERVING", ...) of the server ("") or one model."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        request = health_pb2.HealthCheckRequest(service=service)
        reply = self._call(stub.Check, request, self.deadline(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # --- plumbing ---------------------------------------------------------------------------------

    def _list_models(self, deadline: float | None) -> pb.ListModelsResponse:
        return self._call(self._stub.ListModels, pb.ListModelsRequest(), deadline)

    def _known_limits(self, deadline: float | None) -> Limits:
        if self._limits is None:
            self._limits = Limits.from_proto(self._list_models(deadline).limits)
        return self._limits

    def _batch_size(self, deadline: float | None) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return self.server_batch_size(self._known_limits(deadline))

    def _image_sizes(self, deadline: float | None) -> tuple[int, int]:
        return self.image_sizes(self._batch_size(deadline), self._known_limits(deadline))

    def _call(self, method, request, deadline: float | None):
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=time_left(deadline), metadata=self.metadata)
            except grpc.RpcError as err:
                delay = self.retry.delay(err.code(), attempt, deadline)
                if delay is None:
                    raise error_from(err) from None
            time.sleep(delay)

    def _run(self, plan: plans.Plan, deadline: float | None):
        method = getattr(self._stub, plan.method)
        if len(plan.requests) == 1:
            return plan.merge([self._call(method, plan.requests[0], deadline)])
        gate = threading.Semaphore(self.requests_in_flight(plan))

        def gated(request):
            with gate:
                return self._call(method, request, deadline)

        futures = [self._executor().submit(gated, r) for r in plan.requests]
        try:
            return plan.merge([f.result() for f in futures])
        finally:
            for f in futures:
                f.cancel()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.parallel_requests, thread_name_prefix="embedserv-client")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
