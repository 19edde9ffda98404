"""The tokenizer's own calls: Tokenize (TEI's /tokenize, our Tokenize RPC), Decode, and the prompt a chat
template makes for /v1/chat/completions."""

from __future__ import annotations

from embedserv.engine import checks
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel
from embedserv.types import Task, TokenizedText


class Tokens:
    def __init__(self, core: Core, served: ServedModel) -> None:
        self._core = core
        self._info = served.info
        self._tokenizer = served.tokenizer

    async def tokenize(
        self, texts: list[str], add_special_tokens: bool, prompt_name: str | None
    ) -> list[TokenizedText]:
        return await self._core.tokenize_with(self._tokenizer.tokenize, texts, add_special_tokens, prompt_name)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self._core.tokenize_with(self._tokenizer.decode, ids, skip_special_tokens)

    async def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text the model's chat template makes of `messages` (refused when it has none)."""
        checks.require(self._info, Task.GENERATE, "chat")
        return await self._core.tokenize_with(self._tokenizer.apply_chat_template, messages)
