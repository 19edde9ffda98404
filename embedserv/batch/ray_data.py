"""embedserv as a Ray Data stage, for corpora that outgrow one machine: a callable class for
`Dataset.map_batches`, one engine per Ray actor (Ray places the actors over the cluster's nodes and GPUs).

    import ray
    from embedserv.batch.ray_data import Embedder

    ds = ray.data.read_parquet("s3://bucket/corpus/")
    ds = ds.map_batches(
        Embedder,
        fn_constructor_kwargs={"model": "/models/bge-base-en-v1.5", "device": "cuda"},
        concurrency=8,     # actors: e.g. one per GPU of the cluster
        num_gpus=1,        # per actor (0 on CPU nodes)
        batch_size=1024,
    )
    ds.write_parquet("s3://bucket/vectors/")

Ray is not a dependency of embedserv: install it beside it (`pip install 'embedserv[ray]'`).
"""

from __future__ import annotations

import numpy as np

from embedserv.config import ModelConfig
from embedserv.engine.sync import SyncEngine
from embedserv.types import EmbedParams


class Embedder:
    """`__call__` takes a batch (a dict of columns, or a pandas DataFrame) with the `column` texts and returns it
    with `output_column` added: one float32 vector per row, equal to what `embedserv serve` answers."""

    def __init__(
        self,
        model: str,
        column: str = "text",
        output_column: str = "embedding",
        params: EmbedParams | None = None,
        **model_options,
    ) -> None:
        """`model`: a local model directory on every node; `model_options`: ModelConfig's fields (device,
        dtype, max_batch_tokens, ...), as `embedserv serve` takes them; `params`: normalize, truncate (default
        on), prompt_name, dimensions."""
        config = ModelConfig(path=model, served_name=model_options.pop("served_name", "model"), **model_options)
        self.engine = SyncEngine(config)
        self.column, self.output_column = column, output_column
        self.params = params or EmbedParams(truncate=True)

    def __call__(self, batch):
        texts = [str(text) for text in batch[self.column]]
        result = self.engine.embed(texts, self.params) if texts else None
        vectors = result.embeddings if result is not None else np.zeros((0, 0), np.float32)
        if isinstance(batch, dict):
            return {**batch, self.output_column: vectors}
        batch = batch.copy()
        batch[self.output_column] = list(vectors)
        return batch

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
