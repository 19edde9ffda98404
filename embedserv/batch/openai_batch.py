"""OpenAI batch files (`custom_id`, `method`, `url`, `body` per line) answered by the server's own HTTP routes,
in process: each line's body goes to its url on the same ASGI app `embedserv serve` runs (no socket), so
/v1/embeddings, /v1/rerank, /classify, /embed_sparse and every other POST route answer exactly as the server
would, errors included. Output lines are OpenAI's batch output: `id`, `custom_id`, `response` (`status_code`,
`request_id`, `body`) and `error` (for a line that could not be sent at all)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx

from embedserv.batch.inputs import Row
from embedserv.batch.runner import ShardDone
from embedserv.config import ServerConfig
from embedserv.engine.engine import Engine
from embedserv.server.frontend import Frontend, InflightLimiter, ServedModels
from embedserv.server.http.app import build_app
from embedserv.server.http.edge import Edge


class OpenAIBatch:
    def __init__(self, engine: Engine, config: ServerConfig, concurrency: int) -> None:
        # The limit admits every line in flight at its largest (the server's limit is for many clients).
        limit = max(config.max_concurrent_requests, concurrency * config.max_client_batch_size)
        config = replace(config, max_concurrent_requests=limit, api_key=None, api_keys=None)
        frontend = Frontend(ServedModels([engine.info.name]), config, InflightLimiter.for_config(config))
        frontend.models.add(engine)
        transport = httpx.ASGITransport(app=Edge(build_app(frontend), frontend))
        self.client = httpx.AsyncClient(transport=transport, base_url="http://embedserv-batch", timeout=None)
        self._lines = asyncio.Semaphore(concurrency)

    def start(self, shard: list[Row]) -> asyncio.Task:
        return asyncio.create_task(self._shard(shard))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _shard(self, shard: list[Row]) -> ShardDone:
        answers = await asyncio.gather(*(self._answer(row) for row in shard))
        lines = [json.dumps(line) for line, _ in answers]
        errors = [
            {"row": row.index, "id": row.id, "error": error}
            for row, (_, error) in zip(shard, answers, strict=True)
            if error
        ]
        return ShardDone(shard[0].index, len(shard), lines, errors, 0)

    async def _answer(self, row: Row) -> tuple[dict, str | None]:
        """(the output line, the error message or None)."""
        line: dict = {"id": f"batch_req_{row.index}", "custom_id": row.id, "response": None, "error": None}
        request = row.request or {}
        method = str(request.get("method", "POST")).upper()
        if row.error is None and method != "POST":
            row = replace(row, error=f"method {method}: only POST routes are answered in a batch")
        if row.error is not None:
            line["error"] = {"code": "invalid_request", "message": row.error}
            return line, row.error
        async with self._lines:
            reply = await self.client.post(str(request["url"]), json=request["body"])
        try:
            body = reply.json()
        except ValueError:
            body = reply.text
        line["response"] = {
            "status_code": reply.status_code,
            "request_id": reply.headers.get("x-request-id", ""),
            "body": body,
        }
        if reply.is_success:
            return line, None
        return line, f"HTTP {reply.status_code}: {_message(body)}"


def _message(body: object) -> str:
    """The error message of any of our error shapes (OpenAI's, TEI's, Cohere's)."""
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict):
            return str(inner.get("message", inner))
        return str(inner or body.get("message") or body)
    return str(body)
