"""What the model runner and the loader may call on a model: one Protocol per kind of model.

Every model class is an nn.Module that also subclasses the Protocol of its kind, which gives it the defaults
below once; a family sets only what differs (RoBERTa's position offset, Gemma 4's prefill-skip layer, ...).
The runner picks its call by the declared `kind` (worker/model_runner.py) and never probes a model for
attributes. Every forward returns [num_rows, hidden]: the step's rows (padding rows included), or, given the
prefill skip's kept rows, those. Positions come already shifted by `position_offset`.

- EncoderModel: attends both ways (unless --attention says otherwise): `forward(input_ids, positions)`, plus
  `token_type_ids` where it reads token types, `adapter_ids` where it has built-in task adapters, and
  `pixel_values` and `image_grids` where it takes images (ColModernVBERT, as a vision-language decoder does).
- DecoderModel: `forward(input_ids, positions)`, causal unless its config says otherwise; plus
  `prefill_skip_rows` where its last layers share KV, `pixel_values` and `image_grids` where it takes images
  (vision-language models: the features take the image placeholder tokens' places).
- EncoderDecoderModel: `forward(input_ids, positions, encoder_input_ids, encoder_positions)`: the decoder's
  states, the encoder run first over the encoder inputs given (None: none runs in this step).
- DualEncoderModel: a text tower and a vision tower, one per pass: `forward(input_ids, positions,
  pixel_values, image_grids)` (pixel_values None: the text pass), pooled by the model's own `pool`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from embedserv.models.mrope import MRopeSpec
    from embedserv.models.vision_windows import VisionWindows

_NONE: Mapping = MappingProxyType({})


class ModelKind(str, Enum):
    ENCODER = "encoder"
    DECODER = "decoder"
    ENCODER_DECODER = "encoder-decoder"
    DUAL_ENCODER = "dual encoder"


class Model(Protocol):
    """What every kind declares."""

    kind: ClassVar[ModelKind]
    # Added to every position (RoBERTa / XLM-R and MPNet count from pad_token_id + 1, BART from 2, PaliGemma
    # from 1); the input builder adds it.
    position_offset: int = 0
    # M-RoPE (Qwen2-VL's language model): the image token and merge the input builder computes 3-D positions by
    # (models/mrope.py), so `positions` is [3, num_rows]; None: positions are [num_rows].
    mrope: MRopeSpec | None = None
    # A vision tower whose windowed attention layers attend within windows (Qwen2.5-VL's): the input builder
    # gives them the windows' metadata from the image grids (models/vision_windows.py).
    vision_windows: VisionWindows | None = None
    # --kv-sharing-fast-prefill: the first layer after the last one that writes KV; from there on the layers
    # run only the rows whose output is read (worker/prefill_skip.py). None: no layer shares another's KV.
    prefill_skip_layer: int | None = None
    # The step's images may reach the model: a dual encoder's image pass, a vision-language model's pages.
    takes_images: ClassVar[bool] = False
    # Published config.json forms the model also reads (custom-code configs): config.json's model_type -> a
    # function of its raw dict giving the native transformers config dict (with its model_type), or None when
    # the dict is not that form. Only the dict is read; the code it points at never runs.
    config_forms: ClassVar[Mapping[str, Callable[[dict], dict | None]]] = _NONE
    # Custom sentence-transformers module types (modules.json) that only wrap this model as
    # sentence-transformers' Transformer does: read as Transformer, their code never imported.
    st_transformer_modules: ClassVar[tuple[str, ...]] = ()

    @property
    def max_positions(self) -> int:
        """Positions the model takes (after the offset's)."""
        raise NotImplementedError

    @staticmethod
    def text_config(hf_config):
        """The config of the model's language model (its heads are what the attention backend runs, its flags
        say whether attention is causal): the config itself but for vision-language models."""
        return hf_config

    def fill_defaults(self) -> None:
        """Fills what checkpoints may leave out, after allocation and before loading (Gemma 4's layer scalars)."""


class EncoderModel(Model, Protocol):
    kind: ClassVar[ModelKind] = ModelKind.ENCODER
    # Segment embeddings: forward takes `token_type_ids` ([num_rows] int64; None: every token is type 0).
    # Encoders without them are sent none.
    reads_token_types: ClassVar[bool] = False
    # Built-in task adapters (jina-embeddings-v3): forward takes `adapter_ids` ([num_rows] int64, -1 for no
    # adapter; None: no token has one).
    has_task_adapters: ClassVar[bool] = False
    # config.json's model_type -> where its *ForMaskedLM checkpoint keeps the MLM head, a loading/family.py
    # MlmHeadNames (SPLADE reads it; typed loosely: the records import this module).
    mlm_heads: ClassVar[Mapping[str, object]] = _NONE

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


class DecoderModel(Model, Protocol):
    kind: ClassVar[ModelKind] = ModelKind.DECODER

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


class EncoderDecoderModel(Model, Protocol):
    kind: ClassVar[ModelKind] = ModelKind.ENCODER_DECODER
    # The LM head's logits bias, by checkpoint names, the first found (BART's `final_logits_bias`; zeros when
    # the checkpoint lacks it); (): the head has none.
    final_logits_bias: ClassVar[tuple[str, ...]] = ()

    @staticmethod
    def output_scale(hf_config) -> float:
        """What the LM head multiplies the decoder's last states by (T5 v1.0's tied head: d_model**-0.5)."""
        return 1.0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_positions: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class DualEncoderModel(Model, Protocol):
    kind: ClassVar[ModelKind] = ModelKind.DUAL_ENCODER
    takes_images: ClassVar[bool] = True
    # A class-token row leads each image's rows (CLIP).
    class_token: ClassVar[bool] = False

    @property
    def image_shape(self) -> tuple[int, int, tuple[int, int]]:
        """(rows, values per row, grid) of a full-size image's sequence: the runner's warm-up makes such images."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grids: tuple[tuple[int, ...], ...] = (),
    ) -> torch.Tensor: ...

    def pool(self, hidden: torch.Tensor, pooling, images: bool) -> torch.Tensor:
        """[num_seqs, dim] float: each sequence's vector in the joint space, each tower by its own head
        (`pooling`: the runner's heads/pooling.PoolingInputs; `images`: the image pass)."""
        raise NotImplementedError
