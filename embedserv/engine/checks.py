"""What the engine checks of a call before it tokenizes anything; each failure says what to change."""

from __future__ import annotations

from embedserv.engine.tokenizer import TextTokenizer
from embedserv.errors import InvalidInput
from embedserv.models.tasks import TaskSpec
from embedserv.types import EmbedParams, ModelInfo, RerankParams, Task, TruncationDirection


def require(info: ModelInfo, task: Task, rpc: str) -> None:
    if task not in info.tasks:
        tasks = ", ".join(t.value for t in info.tasks)
        raise InvalidInput(f"model {info.name!r} cannot serve {rpc}; it serves: {tasks}")


def check_direction(direction: str) -> None:
    if direction not in tuple(TruncationDirection):
        raise InvalidInput(f"truncation_direction must be right or left, not {direction!r}")


def check_embed(info: ModelInfo, tokenizer: TextTokenizer, texts: list[str], params: EmbedParams) -> None:
    if not texts:
        raise InvalidInput("inputs is empty; send at least one text")
    if params.dimensions is not None and not 1 <= params.dimensions <= info.dimension:
        raise InvalidInput(
            f"dimensions must be between 1 and the model's dimension {info.dimension}, not {params.dimensions}"
        )
    check_direction(params.truncation_direction)
    # Unknown prompt names fail before any tokenizing.
    tokenizer.resolve_prompt(params.prompt_name)


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
