"""The token head of ColPali-style retrievers (transformers' ColQwen2ForRetrieval, ColPaliForRetrieval,
ColModernVBertForRetrieval): every
token's last hidden state through `embedding_proj_layer`, then L2-normalized."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.loading.checkpoint import read_tensors

PROJECTION = "embedding_proj_layer"
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
    names = {f"{PROJECTION}.weight", f"{PROJECTION}.bias"}
    tensors = read_tensors(spec.files, names)
    if f"{PROJECTION}.weight" not in tensors:
        raise ConfigError(f"checkpoint {spec.model_dir} lacks {PROJECTION}.weight, the retriever's projection")
    weight = tensors[f"{PROJECTION}.weight"]
    head = ProjectionHead(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.proj.weight.copy_(weight)
        bias = tensors.get(f"{PROJECTION}.bias")
        head.proj.bias.copy_(bias if bias is not None else torch.zeros(weight.shape[0]))
    return head.to(device=spec.device, dtype=spec.dtype).eval().requires_grad_(False)
