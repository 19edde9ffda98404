"""What Embed can return for a model, read from its files: a dense vector, a sparse vector, token vectors.

- A SentenceTransformer directory (or a plain encoder) gives the dense vector; its token vectors are its
  last hidden states (late chunking, plain ColBERT-free token embeddings).
- A SparseEncoder directory (fill-mask Transformer + SpladePooling), or a plain *ForMaskedLM directory
  served with `--pooling splade` (TEI's behaviour: max of log(1 + relu(logits))), gives the sparse vector
  only, over the vocabulary.
- A MultiVectorEncoder directory gives token vectors only: its Dense and Normalize on every token, its
  query/document prompts, lengths and masks.
- ColQwen2 / ColPali (ColQwen2ForRetrieval, ColPaliForRetrieval) give token vectors only: the projection
  and L2 norm on every token of a query or a page image.
- bge-m3 (an XLM-R checkpoint with sparse_linear and colbert_linear head files beside it) gives all three:
  CLS dense, the sparse head per token (max per token id, special tokens dropped), and the colbert head on
  every token but the first, normalized; one forward pass serves any mix of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from embedserv.errors import ConfigError
from embedserv.models.heads.vision_retrieval import RETRIEVAL_ARCHITECTURES, projection_width
from embedserv.models.loading.multi_vector_files import read_multi_vector_settings
from embedserv.models.loading.st_files import (
    MULTI_VECTOR_ENCODER,
    SPARSE_ENCODER,
    SentenceTransformerFiles,
    SpladeSpec,
)
from embedserv.types import EmbedOutput, Task

# bge-m3's head files, by the names FlagEmbedding saves them under (.pt) or a safetensors conversion.
BGE_M3_HEADS = ("sparse_linear", "colbert_linear")
# The head kind of *ForTokenClassification models (models/registry.HEAD_KINDS): no Embed output; their per-token
# logits travel as token vectors.
TOKEN_CLASSIFIER = "token_classifier"
SPLADE_POOLING = "splade"


@dataclass(frozen=True)
class OutputSpec:
    outputs: tuple[EmbedOutput, ...]
    # Which heads make the sparse and token vectors, an entry of models/registry.HEAD_KINDS: "hidden" (no
    # sparse output, the last hidden states as token vectors), "splade", "multi_vector_encoder" or "bge_m3";
    # None for a model without these outputs.
    head_kind: str | None = None
    splade: SpladeSpec | None = None
    sparse_dimension: int = 0
    multi_vector_dimension: int = 0
    # bge-m3: its head files (sparse_linear, colbert_linear), .safetensors or .pt.
    head_files: tuple[Path, ...] = ()

    @property
    def tasks(self) -> tuple[Task, ...]:
        tasks = ()
        if EmbedOutput.DENSE in self.outputs:
            tasks += (Task.EMBED,)
        if EmbedOutput.SPARSE in self.outputs:
            tasks += (Task.EMBED_SPARSE,)
        if EmbedOutput.MULTI_VECTOR in self.outputs:
            tasks += (Task.EMBED_MULTI_VECTOR,)
        return tasks


def head_file(model_dir: Path, name: str) -> Path | None:
    """`name`.safetensors, else `name`.pt, in the model directory; None when neither is there."""
    for suffix in (".safetensors", ".pt"):
        path = model_dir / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def read_output_spec(
    model_dir: Path,
    hf_config,
    st: SentenceTransformerFiles,
    pooling_flag: str | None,
    architecture: str,
    embeds: bool,
) -> OutputSpec:
    """The outputs of a model that embeds (`embeds`: its task spec says it does), or none."""
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    # Vision-language configs (Qwen2-VL) keep the language model's width in their text config.
    hidden = int(getattr(hf_config, "hidden_size", 0) or getattr(hf_config.get_text_config(), "hidden_size", 0) or 0)
    if st.model_type == SPARSE_ENCODER or pooling_flag == SPLADE_POOLING:
        if not architecture.endswith("ForMaskedLM") and st.model_type != SPARSE_ENCODER:
            raise ConfigError(
                f"{model_dir}: --pooling splade needs a masked-LM checkpoint (*ForMaskedLM), "
                f"not {architecture or 'this model'}"
            )
        return OutputSpec(
            (EmbedOutput.SPARSE,), head_kind="splade", splade=st.splade or SpladeSpec(), sparse_dimension=vocab
        )
    if not embeds:
        return OutputSpec(())
    if architecture in RETRIEVAL_ARCHITECTURES:
        width = projection_width(hf_config)
        return OutputSpec((EmbedOutput.MULTI_VECTOR,), head_kind="vision_retrieval", multi_vector_dimension=width)
    if st.model_type == MULTI_VECTOR_ENCODER:
        # Refuses at start-up what would not give the library's vectors (loading/multi_vector_files.py).
        read_multi_vector_settings(model_dir, st, hidden)
        dense = st.multi_vector.dense
        dimension = dense[-1].out_features if dense else hidden
        return OutputSpec(
            (EmbedOutput.MULTI_VECTOR,), head_kind="multi_vector_encoder", multi_vector_dimension=dimension
        )
    heads = [head_file(model_dir, name) for name in BGE_M3_HEADS]
    if any(heads):
        if not all(heads):
            missing = [name for name, path in zip(BGE_M3_HEADS, heads, strict=True) if path is None]
            raise ConfigError(
                f"{model_dir}: a bge-m3 checkpoint needs both head files; {', '.join(missing)} is missing"
            )
        return OutputSpec(
            (EmbedOutput.DENSE, EmbedOutput.SPARSE, EmbedOutput.MULTI_VECTOR),
            head_kind="bge_m3",
            sparse_dimension=vocab,
            multi_vector_dimension=hidden,
            head_files=tuple(heads),
        )
    return OutputSpec((EmbedOutput.DENSE, EmbedOutput.MULTI_VECTOR), head_kind="hidden", multi_vector_dimension=hidden)
