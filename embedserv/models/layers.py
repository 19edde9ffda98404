"""Small building blocks shared by the models, and the row counts they run at on CPU.

Row padding: the model and its heads run a bounded set of row counts (padded_rows). oneDNN, which runs our CPU
linears (int8 too) and torch's bfloat16 matmuls, builds a primitive for every shape it is given and keeps it in
two caches of 1,024 entries each (oneDNN's own and ideep's; about 0.3 MiB an entry on MiniLM's shapes). Steps of
every possible size churned both caches without end, and their long-lived entries interleaved with each step's
activations in the heap, which then grew without bound: 80 to 125 MiB a minute under steady load
(docs/performance-history.md, "Memory under steady load"). Padded to a bounded set of sizes, every primitive is built
once and stays cached, and the heap stops growing.

The input builder pads the step's token rows (and the encoder's, the prefill skip's kept rows and the sampled
rows); padding rows belong to no sequence: attention leaves them out and yields zeros there, and the runner drops
them before the heads. Heads whose rows are sequences or tokens (Dense poolers, token, sparse and colbert heads)
pad and cut back their own (on_padded_rows). A worker's warm-up runs the model's linears at every count
(row_counts; warm_linear_row_counts), so no primitive is built mid-step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embedserv.models.int8 import Int8Weight

# Row counts up to 256 are padded to a multiple of this; above, to 16 sizes per power of two.
_MIN_STEP = 16


def padded_rows(num_rows: int) -> int:
    """`num_rows` rounded up to the next multiple of 16 up to 256, and above that to the next multiple of
    1/16 of the power of two below it: at most 6.25% more rows from 256 on, 80 sizes from 1 to 4,096."""
    step = max(_MIN_STEP, 1 << max(0, num_rows.bit_length() - 5))
    return -(-num_rows // step) * step


def row_counts(max_rows: int) -> list[int]:
    """Every count padded_rows() gives for 1..max_rows rows (the last may exceed max_rows)."""
    counts = [padded_rows(1)]
    while counts[-1] < max_rows:
        counts.append(padded_rows(counts[-1] + 1))
    return counts


def pad(values: np.ndarray, rows: int) -> np.ndarray:
    """`values` followed by zeros up to `rows` entries."""
    if len(values) >= rows:
        return values
    return np.concatenate((values, np.zeros(rows - len(values), dtype=values.dtype)))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# Hugging Face `hidden_act` names -> functions, as transformers' ACT2FN defines them.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}

# The same activations as oneDNN post-ops (attr, algorithm); quick_gelu has none and runs unfused.
_ONEDNN_POST_OPS = {
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_fast": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
    "silu": ("swish", ""),
    "swish": ("swish", ""),
    "tanh": ("tanh", ""),
}


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}") from None


def copy_checked(destination: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copies a checkpoint tensor into a parameter (or a slice of one) of the same shape."""
    # copy_ would broadcast a wrongly shaped tensor without a word (a config that does not fit the weights).
    if destination.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the config says {tuple(destination.shape)}"
        )
    destination.copy_(tensor)


def is_heterogeneous(config) -> bool:
    """transformers 5 configs whose layers differ (`per_layer_config`, Gemma 4): reading a per-layer value
    such as head_dim off the global config raises there, so it is read per layer."""
    return bool(getattr(config, "is_heterogeneous", False))


def head_dim(config) -> int:
    """Per-head width: Qwen3 (and some Mistrals) set head_dim apart from hidden_size / num_attention_heads,
    T5 calls it d_kv. Configs with per-layer sizes (Gemma 4) give their largest."""
    if is_heterogeneous(config):
        return max(head_dim(layer) for layer in config.per_layer_config)
    return (
        getattr(config, "head_dim", None)
        or getattr(config, "d_kv", None)
        or config.hidden_size // config.num_attention_heads
    )


def num_kv_heads(config) -> int:
    """Key/value heads: fewer than the query heads under grouped-query attention; encoders have as many.
    Configs with per-layer counts (Gemma 4) give their largest."""
    if is_heterogeneous(config):
        return max(num_kv_heads(layer) for layer in config.per_layer_config)
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _onednn_can_run(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear(nn.Module):
    """`activation(x @ weight.T + bias)`, or `x @ weight.T + bias + residual`.

    On CPU, `pack()` reorders the weight once for oneDNN, whose matmul runs these shapes 1.5-2.5x faster
    than the default float32 path here and takes the bias, the activation or the residual add as fused
    post-ops (one pass over the output instead of three). Elsewhere it is F.linear plus plain ops.
    """

    # A packed Linear (q/k/v in one qkv, gate/up in one gate_up) stacks its checkpoint's shards, of these
    # output sizes in order; the weight loader (loading/weights.py) fills each shard's rows.
    shard_sizes: tuple[int, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.activation = activation
        self._activation_fn = get_activation(activation) if activation else None
        self._packed: torch.Tensor | None = None
        self._int8: Int8Weight | None = None

    def pack(self) -> None:
        """Call after the weights are loaded and cast; a later `.to()` needs another pack()."""
        self._packed = None
        if _onednn_can_run(self.weight) and (self.activation is None or self.activation in _ONEDNN_POST_OPS):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def quantize_int8(self, levels: int, activation_levels: int = 255) -> None:
        """Swaps the float weight for int8 with weights in [-levels, levels] and activations in
        [0, activation_levels] (--quantization int8; models/int8.py)."""
        self._int8 = Int8Weight(self.weight.detach(), self.bias, levels, activation_levels)
        self._packed = None
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # the float copy is not kept

    def without_activation(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T + bias`, leaving out the fused activation (a LoRA update goes in before it)."""
        if self._int8 is not None:
            return self._int8.matmul(x)
        if self._packed is not None and x.dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None and self.activation is not None:
            raise ValueError("a Linear fuses an activation or a residual, not both")
        if self._int8 is not None:
            return self._int8.matmul(x, self._activation_fn, residual)
        if self._packed is not None and x.dtype == self.weight.dtype:
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self._packed, self.bias, "add")
            attr, algorithm = _ONEDNN_POST_OPS[self.activation] if self.activation else ("none", "")
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, attr, [], algorithm)
        out = F.linear(x, self.weight, self.bias)
        if self._activation_fn is not None:
            out = self._activation_fn(out)
        if residual is not None:
            out = out + residual
        return out


def on_padded_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a module that maps each row on its own (a head's linear), run on CPU over x padded
    with zero rows to padded_rows(len(x)) and cut back: heads whose row counts follow the sequences or tokens
    of a step keep to a bounded set of oneDNN shapes (models/layers.py)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if x.device.type != "cpu" or padded == rows:
        return module(x)
    return module(F.pad(x, (0, 0, 0, padded - rows)))[:rows]


def warm_linear_row_counts(
    model: nn.Module, run: Callable[[], None], row_counts: Iterable[int], unfused: bool = False
) -> int:
    """Runs `run()` (steps through `model`), then each distinct Linear call it made once at every row count
    in `row_counts`, on zeros (with `unfused`, an activated Linear's call without its activation too: the
    one --lora adapters' rows make); returns the calls made. oneDNN builds and caches a primitive per shape, and
    one built mid-step lands between the step's buffers in the heap and keeps that memory: a worker's RSS
    rose in 10-20 MiB steps for every row count it met for the first time (models/layers.py)."""
    calls: dict[tuple, tuple[Linear, bool]] = {}

    def record(module: Linear, args: tuple, kwargs: dict) -> None:
        x, residual = args[0], kwargs.get("residual", args[1] if len(args) > 1 else None)
        signature = (
            module.in_features,
            module.out_features,
            module.bias is None,
            module._int8 is not None,
            module._packed is not None,
            module.activation,
            x.dtype,
            residual is not None,
        )
        calls.setdefault(signature, (module, residual is not None))

    linears = [module for module in model.modules() if isinstance(module, Linear)]
    hooks = [module.register_forward_pre_hook(record, with_kwargs=True) for module in linears]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    made = 0
    counts = sorted(row_counts, reverse=True)
    with torch.inference_mode():
        for signature, (module, with_residual) in calls.items():
            dtype = signature[-2]
            x = torch.zeros(counts[0], module.in_features, dtype=dtype)
            residual = torch.zeros(counts[0], module.out_features, dtype=dtype) if with_residual else None
            for rows in counts:
                module(x[:rows], residual=None if residual is None else residual[:rows])
                made += 1
                if unfused and module.activation is not None:
                    module.without_activation(x[:rows])
                    made += 1
    return made


def packed_linear(
    in_features: int, shard_sizes: tuple[int, ...], bias: bool = True, activation: str | None = None
) -> Linear:
    """A Linear whose output stacks checkpoint shards of `shard_sizes` (q/k/v, gate/up): one matmul for all."""
    linear = Linear(in_features, sum(shard_sizes), bias=bias, activation=activation)
    linear.shard_sizes = tuple(shard_sizes)
    return linear


def pack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()


def quantize_linears(model: nn.Module, levels: int, activation_levels: int = 255) -> None:
    """Every Linear of the model to int8 (--quantization int8); embeddings, norms and heads stay float."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.quantize_int8(levels, activation_levels)
