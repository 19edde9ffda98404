"""Rerank: cross-encoders and yes/no rerankers score each (query, document) sequence with their score head;
embedding models score by the cosine of the query's and each document's embeddings; late-interaction
models by MaxSim (multi_vector.py); with chunking, each document by its best window (chunking.py).

Documents may be images (ImageInput) for models that take them: text-image dual encoders (CLIP, SigLIP) score
them by the cosine of the query text's and the images' embeddings, ColQwen2 / ColPali by MaxSim of their token
vectors (vision_retrieval.py). A vision-language yes/no reranker (Qwen3-VL-Reranker) scores each pair with its head,
framed by engine/inputs/vl_rerank_rules.py: its documents may be images with text after them, and its query an
image (with text) where the documents are texts; other models take text queries only."""

from __future__ import annotations

import time

from embedserv.engine import checks
from embedserv.engine.inputs import pairs
from embedserv.engine.inputs.image_inputs import encode_inputs, image_indices
from embedserv.engine.inputs.sequence import InputSequence
from embedserv.engine.inputs.token_rules import TokenRules
from embedserv.engine.inputs.vision_retrieval_rules import VisionRetrievalRules
from embedserv.engine.inputs.vl_rerank_rules import VlRerankRules
from embedserv.engine.ports import Core
from embedserv.engine.served_model import ServedModel
from embedserv.engine.tasks import chunking, multi_vector
from embedserv.engine.tasks.outputs import activate, cosine_to_first, rank, stack_rows
from embedserv.engine.tasks.vision_retrieval import rerank_pages
from embedserv.errors import InvalidInput
from embedserv.models.loading.tasks import Seq2SeqYesNoTemplate
from embedserv.types import (
    EmbedOutput,
    EmbedParams,
    ImageInput,
    InterleavedInput,
    Modality,
    RankedDocument,
    RerankMode,
    RerankParams,
    RerankResult,
    Task,
)


class Reranking:
    def __init__(self, core: Core, served: ServedModel, rules: TokenRules) -> None:
        """`rules`: the model's token rules (MultiVectorRules for a model that reranks by MaxSim)."""
        self._core = core
        self._served = served
        self._rules = rules

    async def rerank(
        self, query: str | ImageInput, documents: list[str | ImageInput], params: RerankParams
    ) -> RerankResult:
        """Documents scored against the query, best first: by the model's score head (cross-encoders, yes/no
        rerankers), by cosine similarity of embeddings (embedders), or by MaxSim of token vectors
        (late-interaction models); with chunking, by each document's best window. Documents may be images
        (encoded bytes) for models whose modalities include IMAGE: text-image dual encoders rank them by
        cosine, ColQwen2 / ColPali (page images only) by MaxSim, a vision-language yes/no reranker by its head
        (the one model whose query may be an image)."""
        received = time.perf_counter()
        served, rules = self._served, self._rules
        params = checks.with_truncate(served.info, params)
        checks.require(served.info, Task.RERANK, "Rerank")
        checks.check_rerank(served.info, served.task, query, documents, params)
        images = self._check_images(query, documents)
        if isinstance(rules, VisionRetrievalRules):
            if params.chunking:
                raise InvalidInput(f"model {served.info.name!r} ranks page images whole; leave chunking off")
            return await rerank_pages(self._core, served, rules, query, documents, params, received)
        if images and params.chunking:
            raise InvalidInput(f"chunking applies to text documents; document {images[0]} is an image")
        if isinstance(rules, VlRerankRules):
            if params.chunking:
                checks.check_rerank_chunking(served.info, served.task.rerank_mode)
            instruction = params.instruction or served.task.template.default_instruction
            encoded = await self._core.tokenize_with(rules.encode_pairs, query, documents, instruction, params.truncate)
            return await self._scored(encoded, params, received)
        if images:
            return await self._rerank_images(query, documents, received, params)
        if params.chunking and served.spec.family.vision is not None:
            raise InvalidInput(
                f"model {served.info.name!r} is a text-image dual encoder; chunking is not served for it. Leave it "
                "unset (set truncate to cut long documents)"
            )
        if params.chunking:
            return await chunking.rerank_chunked(self._core, served, query, documents, params, received)
        if served.task.rerank_mode is RerankMode.MAXSIM:
            return await multi_vector.rerank_maxsim(
                self._core, served.tokenizer, self._rules, query, documents, params, received
            )
        return await self._rerank_whole(query, documents, params, received)

    def _check_images(self, query: str | ImageInput, documents: list[str | ImageInput]) -> list[int]:
        """The documents that are images, refused where the model cannot take them (or their text); an image
        query is refused but for a vision-language yes/no reranker."""
        name, images = self._served.info.name, image_indices(documents)
        mixed = ["the query"] * isinstance(query, InterleavedInput)
        mixed += [f"document {i}" for i in images if isinstance(documents[i], InterleavedInput)]
        if mixed:
            raise InvalidInput(
                f"{mixed[0]} holds texts and images interleaved; Rerank takes a text, an image or an image with text "
                "after it as the query and as each document"
            )
        if images and Modality.IMAGE not in self._served.info.modalities:
            raise InvalidInput(f"model {name!r} takes text only; document {images[0]} is an image")
        with_text = [index for index in images if documents[index].text]
        if with_text and not (self._rules.takes_interleaved or isinstance(self._rules, VlRerankRules)):
            raise InvalidInput(
                f"model {name!r} takes an image alone; document {with_text[0]} has text with its image: send the "
                "text as a document of its own"
            )
        if isinstance(query, ImageInput) and not isinstance(self._rules, VlRerankRules):
            raise InvalidInput(
                f"model {name!r} takes a text query, and the query is an image; image queries are served for "
                "vision-language yes/no rerankers (Qwen3-VL-Reranker)"
            )
        return images

    async def _rerank_images(
        self, query: str, documents: list[str | ImageInput], received: float, params: RerankParams
    ) -> RerankResult:
        """A dual encoder's cosine of the query text's and each document's embedding, images among them."""
        embed = EmbedParams(outputs=(EmbedOutput.DENSE,), truncate=params.truncate)
        encoded = await encode_inputs(self._core, self._served, self._rules, [query, *documents], embed)
        outputs, prompt_tokens, timing = await self._core.infer(encoded, received)
        scores = cosine_to_first(stack_rows(outputs))
        results = [RankedDocument(index, score) for index, score in rank(scores, params.top_n)]
        return RerankResult(results=results, prompt_tokens=prompt_tokens, timing=timing)

    async def _rerank_whole(
        self, query: str, documents: list[str], params: RerankParams, received: float
    ) -> RerankResult:
        """Each document is one sequence (cut only with truncate)."""
        task, tokenizer, tokenize = self._served.task, self._served.tokenizer, self._core.tokenize_with
        mode = task.rerank_mode
        if mode is RerankMode.EMBEDDINGS:
            encoded = await tokenize(tokenizer.encode_for_cosine, query, documents, params.truncate)
        elif mode is RerankMode.PAIR:
            encoded = await tokenize(
                pairs.encode_pairs,
                tokenizer,
                query,
                documents,
                params.truncate,
                chars=len(query) + sum(map(len, documents)),
            )
        elif isinstance(task.template, Seq2SeqYesNoTemplate):
            encoded = await tokenize(
                pairs.encode_seq2seq_template, tokenizer, task.template, query, documents, params.truncate
            )
        else:
            instruction = params.instruction or task.template.default_instruction
            encoded = await tokenize(
                pairs.encode_templated, tokenizer, task.template, instruction, query, documents, params.truncate
            )
        return await self._scored(encoded, params, received)

    async def _scored(self, encoded: list[InputSequence], params: RerankParams, received: float) -> RerankResult:
        """The sequences' scores, best first: the score head's (logits with raw_scores), or for an embedder the
        cosine of the query's (the first) and each document's embedding."""
        task = self._served.task
        outputs, prompt_tokens, timing = await self._core.infer(encoded, received)
        rows = stack_rows(outputs)
        if task.rerank_mode is RerankMode.EMBEDDINGS:
            scores = cosine_to_first(rows)
        else:
            scores = rows[:, 0] if params.raw_scores else activate(rows, task.rerank_activation)[:, 0]
        results = [RankedDocument(index, score) for index, score in rank(scores, params.top_n)]
        return RerankResult(results=results, prompt_tokens=prompt_tokens, timing=timing)
