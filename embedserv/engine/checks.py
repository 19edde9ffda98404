"""What the engine checks of a call before it tokenizes anything; each failure says what to change."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.errors import InvalidInput
from embedserv.models.loading.tasks import TaskSpec
from embedserv.types import (
    ClassifyParams, EmbedOutput, EmbedParams, ModelInfo, RerankMode, RerankParams, Task, TruncationDirection,
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
        tasks = ", ".join(t.value for t in info.tasks)
        raise InvalidInput(f"model {info.name!r} cannot serve {rpc}; it serves: {tasks}")


def check_direction(direction: str) -> None:
    if direction not in tuple(TruncationDirection):
        raise InvalidInput(f"truncation_direction must be right or left, not {direction!r}")


_OUTPUT_RPCS = {EmbedOutput.DENSE: "Embed", EmbedOutput.SPARSE: "EmbedSparse", EmbedOutput.MULTI_VECTOR: "EmbedMultiVector"}
_OUTPUT_TASKS = {EmbedOutput.DENSE: Task.EMBED, EmbedOutput.SPARSE: Task.EMBED_SPARSE, EmbedOutput.MULTI_VECTOR: Task.EMBED_MULTI_VECTOR}


def check_outputs(info: ModelInfo, params: EmbedParams) -> None:
    """Every output asked for is one the model gives; the options fit the outputs."""
    if not params.outputs:
        raise InvalidInput("outputs is empty; ask for at least one of dense, sparse, multi_vector")
    if len(set(params.outputs)) != len(params.outputs):
        raise InvalidInput(f"outputs names an output twice: {', '.join(map(str, params.outputs))}")
    if len(params.outputs) == 1:
        require(info, _OUTPUT_TASKS[params.outputs[0]], _OUTPUT_RPCS[params.outputs[0]])
    missing = [str(o) for o in params.outputs if o not in info.outputs]
    if missing:
        gives = ", ".join(map(str, info.outputs)) or "none (it does not embed)"
        raise InvalidInput(f"model {info.name!r} cannot give the {', '.join(missing)} output; its outputs: {gives}")
    if params.sparse_top_k is not None:
        if EmbedOutput.SPARSE not in params.outputs:
            raise InvalidInput("top_k applies to the sparse output; ask for it or leave top_k unset")
        if params.sparse_top_k < 1:
            raise InvalidInput(f"top_k must be at least 1 (or unset for every non-zero value), not {params.sparse_top_k}")
    if params.dimensions is not None and EmbedOutput.DENSE not in params.outputs:
        raise InvalidInput("dimensions applies to the dense output; leave it unset for sparse and multi-vector outputs")


def check_embed(info: ModelInfo, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> None:
    check_outputs(info, params)
    if not texts:
        raise InvalidInput("inputs is empty; send at least one text")
    if params.dimensions is not None and not 1 <= params.dimensions <= info.dimension:
        raise InvalidInput(
            f"dimensions must be between 1 and the model's dimension {info.dimension}, not {params.dimensions}"
        )
    check_direction(params.truncation_direction)
    # Unknown prompt names fail before any tokenizing.
    tokenizer.resolve_prompt(params.prompt_name)


def task_adapter(info: ModelInfo, tokenizer: TextTokenizer, params: EmbedParams) -> tuple[int, str | None]:
    """The call's task adapter (its index in info.adapters; -1: the base weights) and the prompt name to
    tokenize with. `task`, or else a prompt_name that names a task, picks the adapter; the prompt of the
    task's name applies (as sentence-transformers' prompt_name=task) unless prompt_name names another."""
    task = params.task or None
    if task is None and params.prompt_name in info.adapters:
        task = params.prompt_name
    if task is None:
        return -1, params.prompt_name
    if not info.adapters:
        raise InvalidInput(f"model {info.name!r} has no task adapters; leave task unset")
    if task not in info.adapters:
        raise InvalidInput(f"unknown task {task!r}; model {info.name!r} has the tasks: {', '.join(info.adapters)}")
    prompt_name = params.prompt_name or (task if task in tokenizer.prompts else None)
    return info.adapters.index(task), prompt_name


def check_rerank(info: ModelInfo, task: TaskSpec, query: str, documents: list[str], params: RerankParams) -> None:
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
