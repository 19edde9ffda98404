"""What the engine checks of a call before it tokenizes anything; each failure says what to change."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from embedserv.errors import InvalidInput
from embedserv.models.loading.tasks import TaskSpec
from embedserv.types import (
    ClassifyParams,
    EmbedOutput,
    EmbedParams,
    ImageInput,
    ModelInfo,
    RerankMode,
    RerankParams,
    Task,
    TruncationDirection,
)

Params = TypeVar("Params", EmbedParams, RerankParams, ClassifyParams)


def truncates(info: ModelInfo, requested: bool | None) -> bool:
    """Whether a call cuts too-long inputs: its own `truncate` when it says one, else the model's
    --auto-truncate. Every face's calls are resolved here, so the default lives in one place."""
    return info.auto_truncate if requested is None else requested


def with_truncate(info: ModelInfo, params: Params) -> Params:
    """`params` with `truncate` resolved (truncates)."""
    return params if params.truncate is not None else replace(params, truncate=info.auto_truncate)


def require(info: ModelInfo, task: Task, rpc: str) -> None:
    if task not in info.tasks:
        raise not_served(info, rpc)


def not_served(info: ModelInfo, rpc: str) -> InvalidInput:
    tasks = ", ".join(t.value for t in info.tasks)
    return InvalidInput(f"model {info.name!r} cannot serve {rpc}; it serves: {tasks}")


DIRECTIONS = tuple(TruncationDirection)


def check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise bad_direction(direction)


def bad_direction(direction: str) -> InvalidInput:
    return InvalidInput(f"truncation_direction must be right or left, not {direction!r}")


def check_rerank(
    info: ModelInfo, task: TaskSpec, query: str | ImageInput, documents: list, params: RerankParams
) -> None:
    if not query:
        raise InvalidInput("query is empty; send the text to rank documents against")
    if not documents:
        raise InvalidInput("documents is empty; send at least one document to rank")
    if params.top_n is not None and params.top_n < 1:
        raise InvalidInput(f"top_n must be at least 1 (or unset for all results), not {params.top_n}")
    if params.instruction and (task.template is None or not task.template.default_instruction):
        raise InvalidInput(
            f"model {info.name!r} takes no instruction (only instruction-following rerankers do); "
            "leave instruction empty"
        )


def check_embed_chunking(info: ModelInfo, params: EmbedParams) -> None:
    """Chunking averages the windows' dense vectors: it needs a model with a dense output, asked for alone."""
    gives = ", ".join(map(str, info.outputs)) or "none (it does not embed)"
    if EmbedOutput.DENSE not in info.outputs:
        raise InvalidInput(
            f"model {info.name!r} cannot embed by windows (chunking averages dense vectors); its outputs: {gives}"
        )
    if tuple(params.outputs) != (EmbedOutput.DENSE,):
        raise InvalidInput(
            f"chunking gives the dense output only; ask for outputs [dense] alone, or leave chunking off "
            f"(model {info.name!r}'s outputs: {gives})"
        )


_RERANKERS = {RerankMode.TEMPLATE: "a yes/no reranker", RerankMode.MAXSIM: "a late-interaction (MaxSim) reranker"}


def check_rerank_chunking(info: ModelInfo, mode: RerankMode | None) -> None:
    """Windows are scored by cross-encoders and embedding models; other rerankers only cut documents."""
    if mode not in (RerankMode.PAIR, RerankMode.EMBEDDINGS):
        raise InvalidInput(
            f"model {info.name!r} is {_RERANKERS.get(mode, 'not a reranker')} and cannot score documents by "
            "windows (chunking works with cross-encoders and embedding models); leave chunking off and set "
            "truncate to cut documents that do not fit"
        )
