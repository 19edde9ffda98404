"""The token head of ColPali-style retrievers (transformers' ColQwen2ForRetrieval, ColPaliForRetrieval,
ColModernVBertForRetrieval): every
token's last hidden state through `embedding_proj_layer`, then L2-normalized."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.loading.checkpoint import read_tensors

# transformers' name, then colpali-engine's (its ColQwen2 / ColQwen2.5 checkpoints: models/families/colqwen2.py).
PROJECTIONS = ("embedding_proj_layer", "custom_text_proj")
RETRIEVAL_ARCHITECTURES = ("ColQwen2ForRetrieval", "ColPaliForRetrieval", "ColModernVBertForRetrieval")


def projection_width(hf_config) -> int:
    """The token vectors' width: the config's embedding_dim (128 in the published models)."""
    return int(hf_config.embedding_dim)


class ProjectionHead(nn.Module):
    """[n, hidden] rows -> [n, embedding_dim] float32 unit vectors."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, width)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        projected = self.proj(rows.to(self.proj.weight.dtype)).float()
        # As transformers divides by the norm; a zero vector (never seen from a trained model) stays zero.
        return F.normalize(projected, p=2, dim=-1)


def build_projection_head(spec, allow_pickle: bool) -> nn.Module:
    """The head of a ModelSpec's checkpoint, on its device and in its dtype."""
    names = {f"{name}.{part}" for name in PROJECTIONS for part in ("weight", "bias")}
    tensors = read_tensors(spec.files, names)
    found = [name for name in PROJECTIONS if f"{name}.weight" in tensors]
    if not found:
        raise ConfigError(
            f"checkpoint {spec.model_dir} lacks the retriever's projection ({' or '.join(PROJECTIONS)}.weight)"
        )
    weight, bias = tensors[f"{found[0]}.weight"], tensors.get(f"{found[0]}.bias")
    head = ProjectionHead(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.proj.weight.copy_(weight)
        head.proj.bias.copy_(bias if bias is not None else torch.zeros(weight.shape[0]))
    return head.to(device=spec.device, dtype=spec.dtype).eval().requires_grad_(False)
