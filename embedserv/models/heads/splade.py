"""SPLADE: a masked-LM checkpoint's vocabulary logits made into one sparse vector per sequence.

Exactly sentence-transformers' SpladePooling on top of the checkpoint's own MLM head:
- BertForMaskedLM: cls.predictions.transform (dense, config.hidden_act, LayerNorm), then the decoder;
- RobertaForMaskedLM, XLMRobertaForMaskedLM, CamembertForMaskedLM: lm_head (dense, gelu, layer_norm), then
  the decoder;
the decoder is the word embeddings when the config ties them (transformers' rule), else the checkpoint's own
decoder weight, plus the head's bias. Then per token log1p(relu(logits)) (a second log1p for the
`log1p_relu` activation), and the max or the sum over each sequence's tokens. `--pooling splade` on a plain
*ForMaskedLM directory is TEI's splade: max of log1p(relu(logits)).

The logits are made a chunk of tokens at a time, so a 16k-token batch never holds [num_tokens, vocab].
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

from embedserv.errors import ConfigError
from embedserv.models.heads.pooling import TokenInputs
from embedserv.models.interface import ModelKind
from embedserv.models.layers import Linear, on_padded_rows
from embedserv.models.loading.checkpoint import read_tensors
from embedserv.models.loading.family import MlmHeadNames
from embedserv.models.loading.model_spec import ModelSpec
from embedserv.models.loading.st_files import SpladeSpec

# index_reduce_ (the max per sequence) is marked beta; it is the fastest max of rows by index (2x
# scatter_reduce_ here) and its call is stable since torch 1.13.
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")
# Elements of one chunk's [tokens, vocab] float32 logits (128 MiB): 1099 tokens of BERT's vocabulary,
# 133 of XLM-R's.
_LOGITS_PER_CHUNK = 1 << 25


class MlmHead(nn.Module):
    """hidden [n, hidden] -> vocabulary logits [n, vocab]: dense + activation, LayerNorm, decoder + bias."""

    def __init__(self, hidden_size: int, vocab_size: int, activation: str, eps: float) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size, activation=activation)
        self.norm = nn.LayerNorm(hidden_size, eps=eps)
        self.decoder = Linear(hidden_size, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.dense(hidden)))


class SpladeHead(nn.Module):
    """forward(hidden [num_tokens, hidden], tokens) -> (seq, index, value) of every entry above 0, sorted by
    (sequence, vocabulary id); seq and index int64, value float32, all [nnz]."""

    def __init__(self, mlm: MlmHead, splade: SpladeSpec, chunk_tokens: int) -> None:
        super().__init__()
        self.mlm = mlm
        self.pooling = splade.pooling
        self.activation = splade.activation
        self.chunk_tokens = chunk_tokens

    def _weights(self, rows: torch.Tensor) -> torch.Tensor:
        """log1p(relu(logits)) per token and vocabulary id, in float32 (as SpladePooling computes it)."""
        weights = on_padded_rows(self.mlm, rows).float().relu_().log1p_()
        return weights.log1p_() if self.activation == "log1p_relu" else weights

    def _pool(self, weights: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """[num_seqs, vocab]: max or sum of the weights per sequence (weights are >= 0, so 0 starts a max)."""
        pooled = weights.new_zeros(num_seqs, weights.shape[1])
        if self.pooling == "max":
            return pooled.index_reduce_(0, seq, weights, "amax")
        return pooled.index_add_(0, seq, weights)

    def _merge(self, carried: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """One sequence's pooled row from two chunks it spans."""
        return torch.maximum(carried, row) if self.pooling == "max" else carried + row

    def forward(self, hidden: torch.Tensor, tokens: TokenInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = hidden.index_select(0, tokens.rows)
        # Tokens come sequence by sequence, so a chunk covers a run of sequences; the host knows which.
        ends = np.cumsum(np.asarray(tokens.lengths, dtype=np.int64))
        entries = _Entries()
        carried = None
        for start in range(0, rows.shape[0], self.chunk_tokens):
            end = min(start + self.chunk_tokens, rows.shape[0])
            first = int(np.searchsorted(ends, start, side="right"))
            last = int(np.searchsorted(ends, end - 1, side="right"))
            pooled = self._pool(self._weights(rows[start:end]), tokens.seq[start:end] - first, last - first + 1)
            if carried is not None:
                # The previous chunk's last sequence goes on in this chunk.
                pooled[0] = self._merge(carried, pooled[0])
            # The chunk's last sequence may go on in the next chunk: it is kept until that is known.
            carried = pooled[-1] if ends[last] > end else None
            entries.add(first, pooled if carried is None else pooled[:-1])
        return entries.result(hidden.device)


class _Entries:
    """The (seq, index, value) entries above 0 of pooled rows, kept compact as each chunk finishes (a
    batch's [num_seqs, vocab] never exists at once)."""

    def __init__(self) -> None:
        self.seqs: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def add(self, first: int, pooled: torch.Tensor) -> None:
        """Rows [k, vocab] of sequences first, first + 1, ...; they come in sequence order, and nonzero()
        yields row-major order, so the entries stay sorted by (sequence, id)."""
        found = torch.nonzero(pooled > 0)
        local, index = found[:, 0], found[:, 1]
        self.seqs.append(local + first)
        self.indices.append(index)
        self.values.append(pooled[local, index])

    def result(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.seqs:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return empty, empty, torch.zeros(0, dtype=torch.float32, device=device)
        return torch.cat(self.seqs), torch.cat(self.indices), torch.cat(self.values)


def _first(tensors: dict[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor | None:
    return next((tensors[name] for name in names if name in tensors), None)


def _norm_names(prefix: str, kind: str) -> tuple[str, ...]:
    # Old TensorFlow-converted checkpoints name LayerNorm parameters gamma and beta.
    return (f"{prefix}.{kind}", f"{prefix}.{'gamma' if kind == 'weight' else 'beta'}")


def _mlm_tensors(spec: ModelSpec, names: MlmHeadNames) -> dict[str, torch.Tensor]:
    """Our MlmHead's state dict from the checkpoint; a missing tensor is a start-up error."""
    tied = bool(getattr(spec.hf_config, "tie_word_embeddings", True))
    sources = {
        "dense.weight": (f"{names.dense}.weight",),
        "dense.bias": (f"{names.dense}.bias",),
        "norm.weight": _norm_names(names.norm, "weight"),
        "norm.bias": _norm_names(names.norm, "bias"),
        "decoder.weight": names.embeddings if tied else (names.decoder,),
        # transformers 5 ties the decoder's bias to the head's only when it ties the weight (4.x always did,
        # and saved both).
        "decoder.bias": names.bias if tied else names.bias[::-1],
    }
    found = read_tensors(spec.files, {name for candidates in sources.values() for name in candidates})
    state = {}
    for ours, candidates in sources.items():
        tensor = _first(found, candidates)
        if tensor is None:
            raise ConfigError(
                f"{spec.model_dir}: the sparse output needs the checkpoint's masked-LM head, and it lacks "
                f"{' or '.join(candidates)} (save the *ForMaskedLM model, not the bare encoder)"
            )
        state[ours] = tensor
    return state


def build_splade_head(spec: ModelSpec) -> SpladeHead:
    """The SPLADE head of a *ForMaskedLM checkpoint on spec.device in spec.dtype (pooling in float32)."""
    config = spec.hf_config
    model_class = spec.family.model_class
    names = model_class.mlm_heads.get(config.model_type) if model_class.kind is ModelKind.ENCODER else None
    if names is None:
        raise ConfigError(
            f"{spec.model_dir}: the sparse (SPLADE) output reads a masked-LM head, and embedserv knows none for "
            f"model type {config.model_type!r}"
        )
    activation = names.activation or config.hidden_act
    try:
        mlm = MlmHead(config.hidden_size, config.vocab_size, activation, config.layer_norm_eps)
    except ValueError as exc:
        raise ConfigError(f"{spec.model_dir}: the masked-LM head's {exc}") from None
    state = _mlm_tensors(spec, names)
    params = dict(mlm.named_parameters())
    for name, tensor in state.items():
        if tensor.shape != params[name].shape:
            raise ConfigError(
                f"{spec.model_dir}: the masked-LM head's {name} has shape {tuple(tensor.shape)}, the config "
                f"says {tuple(params[name].shape)}"
            )
    mlm.load_state_dict(state)
    mlm = mlm.to(device=spec.device, dtype=spec.dtype).eval().requires_grad_(False)
    mlm.dense.pack()
    mlm.decoder.pack()
    chunk_tokens = max(1, _LOGITS_PER_CHUNK // config.vocab_size)
    return SpladeHead(mlm, spec.outputs.splade or SpladeSpec(), chunk_tokens).eval()
