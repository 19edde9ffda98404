"""MaxSim rerank of MultiVectorEncoder models, as sentence-transformers 6.2 scores: the query as encode_query
(never cut), documents as encode_document (engine/inputs/multi_vector_rules.py), each scored by the sum over the
query's vectors of each one's best dot product with the document's vectors (divided by the query's vector count
for meanmaxsim models); a document without a vector scores -1e9, below every other.
"""

from __future__ import annotations

import numpy as np

from embedserv.engine.inputs.multi_vector_rules import DOCUMENT, QUERY, MultiVectorRules
from embedserv.engine.inputs.tokenizer import TextTokenizer
from embedserv.engine.ports import Core
from embedserv.engine.tasks.outputs import rank
from embedserv.types import EmbedOutput, RankedDocument, RerankParams, RerankResult

# sentence-transformers' score for a document with no vector to take a maximum over.
EMPTY_DOCUMENT_SCORE = -1e9


def maxsim_scores(query: np.ndarray, documents: list[np.ndarray], mean: bool) -> np.ndarray:
    """[len(documents)] float32 MaxSim scores of the query's vectors [n, dim] against each document's."""
    scores = np.empty(len(documents), dtype=np.float32)
    for index, document in enumerate(documents):
        if len(document) == 0:
            scores[index] = EMPTY_DOCUMENT_SCORE
        else:
            scores[index] = (query @ document.T).max(axis=1).sum(dtype=np.float32)
    return scores / max(len(query), 1) if mean else scores


async def rerank_maxsim(
    core: Core,
    tokenizer: TextTokenizer,
    rules: MultiVectorRules,
    query: str,
    documents: list[str],
    params: RerankParams,
    received: float,
) -> RerankResult:
    """Documents scored against the query by MaxSim of their token vectors, best first."""
    encoded = await core.tokenize_with(rules.encode_for_maxsim, tokenizer, query, documents, params.truncate)
    outputs, prompt_tokens, timing = await core.infer(encoded, received, (EmbedOutput.MULTI_VECTOR,))
    tasks = [QUERY] + [DOCUMENT] * len(documents)
    vectors = [o.vectors[rules.keep_for(e.ids, task)] for o, e, task in zip(outputs, encoded, tasks, strict=True)]
    scores = maxsim_scores(vectors[0], vectors[1:], rules.settings.mean_maxsim)
    results = [RankedDocument(index, score) for index, score in rank(scores, params.top_n)]
    return RerankResult(results=results, prompt_tokens=prompt_tokens, timing=timing)
