"""What the sync and async clients share: their settings and the request fields built from them."""

from __future__ import annotations

from collections.abc import Sequence

from embedserv_client import plans
from embedserv_client.images import image_batch_size
from embedserv_client.options import RetryPolicy, Tls, auth_metadata, channel_args, deadline_after
from embedserv_client.types import Limits


class ClientSettings:
    def __init__(
        self,
        target: str,
        api_key: str | None,
        tls: bool | Tls,
        model: str,
        timeout: float | None,
        retry: RetryPolicy | None,
        batch_size: int | None,
        parallel_requests: int,
        load_balancing: str | None,
        options: Sequence[tuple[str, object]],
        priority: int | None = None,
    ):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if parallel_requests < 1:
            raise ValueError(f"parallel_requests must be at least 1, not {parallel_requests}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive seconds or None, not {timeout}")
        self.target = target
        self.tls = tls
        self.model = model
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()
        self.batch_size = batch_size
        self.parallel_requests = parallel_requests
        self.load_balancing = load_balancing
        self.options = list(options)
        # The server's x-priority metadata: every call of this client runs at `priority` (higher sooner).
        self.metadata = auth_metadata(api_key) + (() if priority is None else (("x-priority", str(priority)),))
        self._limits: Limits | None = None

    def __repr__(self) -> str:
        # The API key stays out of reprs and logs.
        return f"{type(self).__name__}(target={self.target!r}, model={self.model!r})"

    def channel_args(self) -> dict:
        return channel_args(self.target, self.tls, self.load_balancing, self.options)

    def deadline(self, timeout: float | None) -> float | None:
        """The call's deadline (monotonic seconds): its own timeout, else the client's."""
        return deadline_after(timeout if timeout is not None else self.timeout)

    def model_name(self, model: str | None) -> str:
        return self.model if model is None else model

    @staticmethod
    def server_batch_size(limits: Limits) -> int:
        # An older server sends no limits (0): one request per call, as before splitting existed.
        return limits.max_client_batch_size or 2**31 - 1

    @staticmethod
    def image_sizes(size: int, limits: Limits) -> tuple[int, int]:
        """(inputs, images) one request may carry, `size` its inputs."""
        return size, image_batch_size(size, limits.max_images_per_request)

    def stream_fields(self, params: dict) -> dict:
        """embed()'s keyword arguments, for embed_stream(); unknown ones are refused at the call."""
        params = dict(params)
        fields = plans.embed_fields(
            self.model_name(params.pop("model", None)),
            params.pop("normalize", None),
            params.pop("truncate", None),
            params.pop("truncation_direction", "right"),
            params.pop("dimensions", None),
            params.pop("prompt_name", None),
            params.pop("encoding", "float32"),
            None,
            params.pop("chunking", None),
            task=params.pop("task", None),
            bypass_cache=params.pop("bypass_cache", False),
        )
        if params:
            raise TypeError(
                f"embed_stream() got unexpected arguments: {', '.join(sorted(params))} (it returns dense matrices: "
                "embed()'s options but outputs and sparse_top_k)"
            )
        return fields

    def requests_in_flight(self, plan: plans.Plan) -> int:
        """How many of a split call's requests go out at once: `parallel_requests`, but never more inputs
        than the server admits (--max-concurrent-requests), or a big batch would refuse itself."""
        if self._limits is None or not self._limits.max_concurrent_requests:
            return self.parallel_requests
        fits = self._limits.max_concurrent_requests // max(plan.inputs_per_request, 1)
        return max(1, min(self.parallel_requests, fits))

    def rerank_fields(
        self,
        model: str | None,
        return_documents: bool,
        raw_scores: bool,
        truncate: bool | None,
        instruction: str,
        chunking: str | None = None,
    ) -> dict:
        return dict(
            model=self.model_name(model),
            return_documents=return_documents,
            raw_scores=raw_scores,
            truncate=truncate,
            instruction=instruction,
            chunking=plans.chunking(chunking, "rerank"),
        )

    def sparse_fields(
        self,
        model: str | None,
        top_k: int | None,
        truncate: bool | None,
        truncation_direction: str,
        prompt_name: str | None,
    ) -> dict:
        fields = dict(
            model=self.model_name(model), truncate=truncate, truncation_direction=plans.direction(truncation_direction)
        )
        if top_k is not None:
            fields["top_k"] = top_k
        if prompt_name:
            fields["prompt_name"] = prompt_name
        return fields

    def multi_vector_fields(self, model: str | None, truncate: bool | None, prompt_name: str | None) -> dict:
        fields = dict(model=self.model_name(model), truncate=truncate)
        if prompt_name:
            fields["prompt_name"] = prompt_name
        return fields

    def classify_fields(
        self,
        model: str | None,
        raw_scores: bool,
        truncate: bool | None,
        truncation_direction: str,
        candidate_labels: Sequence[str] | str | None = None,
        hypothesis_template: str = "",
        multi_label: bool = False,
    ) -> dict:
        if isinstance(candidate_labels, str):
            candidate_labels = [candidate_labels]
        return dict(
            model=self.model_name(model),
            raw_scores=raw_scores,
            truncate=truncate,
            truncation_direction=plans.direction(truncation_direction),
            candidate_labels=plans.strings(list(candidate_labels or ()), "candidate_labels"),
            hypothesis_template=hypothesis_template,
            multi_label=multi_label,
        )

    def tokenize_fields(self, model: str | None, add_special_tokens: bool, prompt_name: str | None) -> dict:
        fields = dict(model=self.model_name(model), add_special_tokens=add_special_tokens)
        if prompt_name:
            fields["prompt_name"] = prompt_name
        return fields
