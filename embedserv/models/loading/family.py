"""The record each model family exports (models/families/*.py, listed in models/registry.py).

A family says, as data, everything outside its own forward pass that depends on it: which Hugging Face
model types it runs, whether its attention is an encoder's, how its checkpoint's tensor names become its
parameters (loading/weights.py reads that), and where its heads keep their tensors (models/heads/ read
those); its model class declares the rest (models/interface.py). Nothing here imports a family or a head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from embedserv.models.interface import ModelKind


@dataclass(frozen=True)
class CheckpointNames:
    """How checkpoint tensor names become our parameter names, in this order:

    1. the first of `prefixes` the name starts with is stripped (`model.`, `bert.`: head classes nest the
       backbone under one);
    2. a name matching `ignored` is skipped (heads, which models/heads read themselves; buffers transformers
       drops on load);
    3. `packed` (fragment, packed fragment, shard): the tensor is one shard of a packed parameter, such as
       q/k/v in one `qkv` and gate/up in one `gate_up` (one matmul instead of three); the packed linear's
       `shard_sizes` say where each shard's rows go;
    4. `renames` (regex, replacement), applied in order.
    """

    prefixes: tuple[str, ...] = ()
    ignored: str | None = None
    packed: tuple[tuple[str, str, int], ...] = ()
    renames: tuple[tuple[str, str], ...] = ()


# q/k/v into one qkv: every family whose checkpoints (or native names) keep them apart.
QKV = (
    ("self_attn.q_proj.", "self_attn.qkv.", 0),
    ("self_attn.k_proj.", "self_attn.qkv.", 1),
    ("self_attn.v_proj.", "self_attn.qkv.", 2),
)
# The packed fragments of a Llama-style attention and gated MLP, which most decoders share.
QKV_GATE_UP = (
    *QKV,
    ("mlp.gate_proj.", "mlp.gate_up.", 0),
    ("mlp.up_proj.", "mlp.gate_up.", 1),
)


@dataclass(frozen=True)
class Classifier:
    """A *ForSequenceClassification head (heads/score.py), or a *ForTokenClassification one (token "every":
    heads/token_classifier.py): which token's state it reads, whether a pooler (dense, activation, optionally a
    LayerNorm) comes before the output layer, and our head parameter -> checkpoint names, the first found wins.

    Our parameters: `dense.weight`, `dense.bias`, `norm.weight`, `norm.bias`, `out.weight`, `out.bias`.
    """

    # "first" (CLS), "last", "mean" (over every token) or "late" (the pooler on every token, then the mean),
    # or a function of the config giving one (ModernBERT's and EuroBERT's classifier_pooling); "every": each
    # token's state (token classification).
    token: str | Callable[[object], str]
    pooler: bool
    sources: Mapping[str, tuple[str, ...]]
    # The pooler's activation (a models/layers.ACTIVATIONS name), or a function of the config giving one.
    activation: str | Callable[[object], str] = "tanh"
    # A LayerNorm after the activation (ModernBERT), with the config's epsilon.
    norm: bool = False
    # Our parameters a checkpoint may lack (bias-free heads): they stay zero.
    optional: tuple[str, ...] = ()

    def token_for(self, hf_config) -> str:
        return self.token(hf_config) if callable(self.token) else self.token

    def activation_for(self, hf_config) -> str:
        return self.activation(hf_config) if callable(self.activation) else self.activation


# Token classifiers: `classifier` (dropout aside) on every token's state, in every family that has one but
# ModernBERT (its prediction head first).
TOKEN_CLASSIFIER = Classifier(
    token="every",
    pooler=False,
    sources={"out.weight": ("classifier.weight",), "out.bias": ("classifier.bias",)},
)


@dataclass(frozen=True)
class MlmHeadNames:
    """Where a *ForMaskedLM checkpoint keeps its MLM head (heads/splade.py); the first name found wins."""

    dense: str
    norm: str
    decoder: str
    # The head's bias, then the decoder's.
    bias: tuple[str, ...]
    embeddings: tuple[str, ...]
    # None: config.hidden_act (BERT); RoBERTa's head always uses gelu.
    activation: str | None


@dataclass(frozen=True)
class VisionTower:
    """A family's image side, as the engine shapes its inputs (engine/served_model.read_vision_spec reads it)."""

    # Pixels per patch side: each patch row holds 3 * patch_size**2 values.
    patch_size: int
    # The square side its position embeddings cover: preprocessing must give images of this size; 0: images
    # keep their own grids (SigLIP 2's NaFlex).
    image_size: int
    # A class-token row (zeros; the model puts its class embedding there) leads each image's rows (CLIP).
    class_token: bool
    # The joint embedding space's width (ModelInfo.dimension).
    dimension: int
    # What ModelInfo.pooling reports: the towers pool through the model's own heads (model.pool).
    pooling: str
    # Texts are padded up to the model's input limit, as the model's processor pads them (SigLIP:
    # padding="max_length"; its text tower reads the last position, a pad), with the tokenizer's pad token,
    # or where it has none this id (the config's).
    pads_texts: bool = False
    text_pad_id: int = 0
    # The image processing layout it takes (engine/inputs/images ImageProcessing.layout).
    layout: str = "chw"


@dataclass(frozen=True)
class Family:
    """What the runtime reads of a family. What only one or two families need, their model class declares
    (models/interface.py); what only docs/MODELS.md reads is their FamilyDocs, beside this record."""

    name: str
    model_types: tuple[str, ...]
    model_class: type[nn.Module]
    # Checkpoint names, or a function of the config where they depend on it (Gemma 4's shared layers).
    checkpoint: CheckpointNames | Callable[[object], CheckpointNames]
    # Encoders attend both ways; decoders are causal unless their config says otherwise.
    is_encoder: bool
    # Architecture (config.json's first) -> its classification head.
    classifiers: Mapping[str, Classifier] = field(default_factory=dict)
    # Architecture -> its token classification head (token "every").
    token_classifiers: Mapping[str, Classifier] = field(default_factory=dict)
    # The token embeddings' checkpoint names: a tied LM head's (and a yes/no reranker's) rows.
    embeddings: tuple[str, ...] = ()
    # PEFT LoRA adapters (--lora) apply to its linears through its checkpoint names (loading/lora_files.py):
    # set where a test shows adapters equal to PEFT's merged model.
    lora: bool = False
    # Dual encoders (CLIP, SigLIP): a function of the config giving its image side; None: texts only.
    vision: Callable[[object], VisionTower] | None = None
    # The pooling of a directory without a sentence-transformers Pooling module (None: mean, as
    # sentence-transformers picks for a plain model): vision-language embedders (GME, DSE) read the last token.
    pooling: str | None = None

    @property
    def is_encoder_decoder(self) -> bool:
        """T5, BART: an encoder over the encoder inputs, a causal decoder reading it."""
        return self.model_class.kind is ModelKind.ENCODER_DECODER

    @property
    def takes_images(self) -> bool:
        """Dual encoders (CLIP, SigLIP) and vision-language models (ColQwen2, ColPali)."""
        return self.model_class.takes_images

    def checkpoint_names(self, hf_config) -> CheckpointNames:
        return self.checkpoint if isinstance(self.checkpoint, CheckpointNames) else self.checkpoint(hf_config)

    def text_config(self, hf_config):
        """The config of the model's language model: its own unless it is a vision-language model."""
        return self.model_class.text_config(hf_config)


@dataclass(frozen=True)
class FamilyDocs:
    """What docs/MODELS.md says of a family beyond its record (docs/models_table.py writes it): published model
    ids it serves, and the test files that show it equals the reference."""

    examples: tuple[str, ...] = ()
    tested_by: tuple[str, ...] = ()
