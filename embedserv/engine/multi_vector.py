"""MultiVectorEncoder models on the host side. Placeholder: being written."""

from __future__ import annotations

from embedserv.engine.embedding import TokenRules


class MultiVectorRules(TokenRules):
    pass


async def rerank_maxsim(engine, query, documents, params, received):
    raise NotImplementedError("MaxSim rerank is being written")
