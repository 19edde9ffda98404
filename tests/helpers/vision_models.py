"""Tiny random-weight CLIP and SigLIP dual encoders for the parity tests (float32, seeded), saved as
transformers saves CLIPModel / SiglipModel directories: config.json, model.safetensors, the bundled WordPiece
tokenizer (tests/helpers/models.py; the config's bos/eos/pad ids are its [CLS]/[SEP]/[PAD], and as [SEP] is
not 2, CLIP pools the first EOS, which ends every text) and preprocessor_config.json.

Images are small (32 px, patches of 8: 16 patches) so the tests stay fast; `clip_vit_b32_config` and
`siglip_base_config` give the published shapes for the benchmarks. Also: images generated as PNG / JPEG /
WebP bytes (numpy -> PIL), and the processors' pixel values as patch rows, the form the engine runs.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from tests.helpers.models import _bundled_tokenizer, _check_weights_saved, _perturb_constant_parameters

_SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=101, eos_token_id=102)
IMAGE_SIZE = 32
PATCH_SIZE = 8
# SigLIP's processor pads every text to this many tokens (its text tower's positions).
SIGLIP_TEXT_LENGTH = 24
SIGLIP2_MAX_PATCHES = 12
SIGLIP2_TEXT_LENGTH = 64
_TOWER = dict(intermediate_size=64, num_hidden_layers=2, initializer_range=0.15, layer_norm_eps=1e-5)


def clip_config(vocab_size: int, image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE):
    from transformers import CLIPConfig

    text = dict(
        _TOWER,
        vocab_size=vocab_size,
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_act="quick_gelu",
        **_SPECIAL_TOKENS,
    )
    vision = dict(
        _TOWER,
        hidden_size=48,
        num_attention_heads=6,
        image_size=image_size,
        patch_size=patch_size,
        hidden_act="quick_gelu",
    )
    # initializer_factor scales CLIP's own init up, so that random outputs are well separated.
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=24, initializer_factor=4.0)


def siglip_config(vocab_size: int, image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE):
    from transformers import SiglipConfig

    # The config's pad id differs from the tokenizer's [PAD] (0), which the processor pads with.
    text = dict(
        _TOWER,
        vocab_size=vocab_size,
        hidden_size=32,
        num_attention_heads=4,
        projection_size=48,
        max_position_embeddings=SIGLIP_TEXT_LENGTH,
        hidden_act="gelu_pytorch_tanh",
        **dict(_SPECIAL_TOKENS, pad_token_id=1),
    )
    vision = dict(
        _TOWER,
        hidden_size=48,
        num_attention_heads=6,
        image_size=image_size,
        patch_size=patch_size,
        hidden_act="gelu_pytorch_tanh",
    )
    return SiglipConfig(text_config=text, vision_config=vision)


def siglip2_config(vocab_size: int, patch_size: int = PATCH_SIZE, num_patches: int = 16):
    from transformers import Siglip2Config

    # transformers reads the bundled vocabulary for this model type with Gemma's tokenizer class, a token per
    # character: room for the test texts.
    text = dict(
        _TOWER,
        vocab_size=vocab_size,
        hidden_size=32,
        num_attention_heads=4,
        projection_size=48,
        max_position_embeddings=SIGLIP2_TEXT_LENGTH,
        hidden_act="gelu_pytorch_tanh",
        **_SPECIAL_TOKENS,
    )
    vision = dict(
        _TOWER,
        hidden_size=48,
        num_attention_heads=6,
        num_patches=num_patches,
        patch_size=patch_size,
        hidden_act="gelu_pytorch_tanh",
    )
    return Siglip2Config(text_config=text, vision_config=vision)


def clip_vit_b32_config(vocab_size: int = 49408):
    """openai/clip-vit-base-patch32's shape (for the benchmarks)."""
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=8,
            max_position_embeddings=77,
            **_SPECIAL_TOKENS,
        ),
        vision_config=dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=224,
            patch_size=32,
        ),
        projection_dim=512,
    )


def siglip_base_config(vocab_size: int = 32000):
    """google/siglip-base-patch16-224's shape (for the benchmarks)."""
    from transformers import SiglipConfig

    return SiglipConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=64,
            **_SPECIAL_TOKENS,
        ),
        vision_config=dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=224,
            patch_size=16,
        ),
    )


def image_processor(kind: str, image_size: int = IMAGE_SIZE):
    """The model's own processor: CLIP's (shortest edge, center crop, CLIP's mean and std) or SigLIP's
    (resize to a square, mean and std 0.5)."""
    if kind == "clip":
        from transformers import CLIPImageProcessorPil

        square = {"height": image_size, "width": image_size}
        return CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size=square)
    if kind == "siglip2":
        from transformers import Siglip2ImageProcessorPil

        # Fewer patches than the model's 16 positions: every image's position embeddings are resized.
        return Siglip2ImageProcessorPil(patch_size=PATCH_SIZE, max_num_patches=SIGLIP2_MAX_PATCHES)
    from transformers import SiglipImageProcessorPil

    return SiglipImageProcessorPil(size={"height": image_size, "width": image_size})


def save_dual_encoder(out: Path | str, kind: str, seed: int = 0, config=None) -> Path:
    """A random CLIPModel (`kind` "clip"), SiglipModel ("siglip") or Siglip2Model ("siglip2") directory;
    `config` overrides the tiny one."""
    import torch
    from transformers import CLIPModel, Siglip2Model, SiglipModel

    out = Path(out)
    tokenizer = _bundled_tokenizer(SIGLIP_TEXT_LENGTH if kind == "siglip" else 64)
    builders = {
        "clip": (clip_config, CLIPModel),
        "siglip": (siglip_config, SiglipModel),
        "siglip2": (siglip2_config, Siglip2Model),
    }
    make_config, model_class = builders[kind]
    config = config or make_config(len(tokenizer))
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _perturb_constant_parameters(model, seed)
    if kind != "clip":
        with torch.no_grad():
            # Zero at init: the probe's projections would otherwise add nothing to check.
            model.vision_model.head.attention.in_proj_bias.normal_(0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    image_processor(kind, getattr(config.vision_config, "image_size", IMAGE_SIZE)).save_pretrained(str(out))
    _check_weights_saved(out)
    return out


def load_reference(model_dir: Path | str):
    """transformers' CLIPModel / SiglipModel on the same directory (float32, eager attention)."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    """A random RGB image, smooth enough that JPEG keeps its shapes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(max(1, height // 4), max(1, width // 4), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def decoded(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def patch_rows(pixel_values: np.ndarray, patch_size: int) -> np.ndarray:
    """[C, H, W] -> [patches, C * P * P], patches row-major, each in (channel, row, column) order."""
    channels, height, width = pixel_values.shape
    grid = pixel_values.reshape(channels, height // patch_size, patch_size, width // patch_size, patch_size)
    return np.ascontiguousarray(grid.transpose(1, 3, 0, 2, 4).reshape(-1, channels * patch_size * patch_size))


# The inputs of one mixed call: texts and images of different sizes and formats, in an interleaved order.
MIXED_TEXTS = ("a photo of a cat", "two dogs playing in the snow, seen from far away", "red")
MIXED_IMAGES = ((20, 31, "PNG"), (64, 64, "JPEG"), (300, 90, "PNG"), (45, 45, "WEBP"))


def mixed_inputs() -> list:
    """Texts and ImageInputs interleaved: text, image, image, text, image, image, text."""
    from embedserv.types import ImageInput

    texts = list(MIXED_TEXTS)
    images = [ImageInput(image_bytes(w, h, fmt, seed=i)) for i, (w, h, fmt) in enumerate(MIXED_IMAGES)]
    return [texts.pop(0) if kind == "t" else images.pop(0) for kind in "tiitiit"]


def reference_embeddings(model_dir: Path, kind: str, inputs: list) -> np.ndarray:
    """transformers' get_text_features / get_image_features of each input, in input order: texts as the
    model's processor tokenizes them (SigLIP: padding="max_length"), images through its image processor."""
    import torch
    from transformers import AutoTokenizer

    from embedserv.types import ImageInput

    model = load_reference(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor = image_processor(kind, getattr(model.config.vision_config, "image_size", IMAGE_SIZE))
    out = []
    with torch.no_grad():
        for item in inputs:
            if isinstance(item, ImageInput):
                # SigLIP 2 also takes the processor's patch mask and grids (spatial_shapes).
                features = dict(processor(images=[decoded(item.data)], return_tensors="pt"))
                out.append(model.get_image_features(**features).pooler_output[0].numpy())
            elif kind != "clip":
                length = model.config.text_config.max_position_embeddings
                ids = tokenizer([item], padding="max_length", max_length=length, return_tensors="pt")
                out.append(model.get_text_features(input_ids=ids["input_ids"]).pooler_output[0].numpy())
            else:
                ids = tokenizer([item], return_tensors="pt")
                out.append(model.get_text_features(**ids).pooler_output[0].numpy())
    return np.stack(out)
