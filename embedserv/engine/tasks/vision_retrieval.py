"""MaxSim rerank of page images by ColQwen2 and ColPali: a text query against page images, the sum over the
query's vectors of each one's best dot product with the page's (processor.score_retrieval, one page at a time: in
a batch it pads shorter pages with zero vectors, which a query vector's best match can be). Text documents are
refused: the processors make texts into queries only (engine/inputs/vision_retrieval_rules.py).
"""

from __future__ import annotations

from embedserv.engine.inputs.image_inputs import encode_inputs
from embedserv.engine.inputs.vision_retrieval_rules import QUERY, VisionRetrievalRules
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel
from embedserv.engine.tasks.multi_vector import maxsim_scores
from embedserv.engine.tasks.outputs import rank
from embedserv.errors import InvalidInput
from embedserv.types import EmbedOutput, EmbedParams, ImageInput, RankedDocument, RerankParams, RerankResult


async def rerank_pages(
    core: Core,
    served: ServedModel,
    rules: VisionRetrievalRules,
    query: str,
    documents: list,
    params: RerankParams,
    received: float,
) -> RerankResult:
    """Page images scored against a text query by MaxSim, best first."""
    texts = [index for index, document in enumerate(documents) if not isinstance(document, ImageInput)]
    if texts:
        raise InvalidInput(
            f"document {texts[0]} is a text, and model {served.info.name!r} ranks page images; send the documents "
            "as images"
        )
    embed = EmbedParams(outputs=(EmbedOutput.MULTI_VECTOR,), prompt_name=QUERY)
    encoded = await encode_inputs(core, served, rules, [query, *documents], embed)
    outputs, prompt_tokens, timing = await core.infer(encoded, received, (EmbedOutput.MULTI_VECTOR,))
    vectors = [output.vectors for output in outputs]
    scores = maxsim_scores(vectors[0], vectors[1:], mean=False)
    results = [RankedDocument(index, score) for index, score in rank(scores, params.top_n)]
    return RerankResult(results=results, prompt_tokens=prompt_tokens, timing=timing)
