"""Small random-weight Qwen2-VL and Qwen2.5-VL checkpoints (Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration) with their processors, for the GME/DSE-style embedder tests, and the
reference embedding: transformers' Qwen2VLModel / Qwen2_5_VLModel (the checkpoint's `.model`) given input_ids,
pixel_values and image_grid_thw from the processor, last token's final hidden state, L2-normalized.

The tower is small (depth 3); Qwen2.5-VL's windows are 56 pixels (2 x 2 merge blocks) with block 1 attending
whole frames, so the test images (tests/helpers/vision_language_models.COLQWEN2_SIZES and larger) hold several
windows, some cut short.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.seq2seq_models import _perturb
from tests.helpers.vision_language_models import _qwen_tokenizer, qwen_text_config, qwen_vision_token_ids

# GME's framing (gme_inference.py), the image part optional; engine/inputs/vl_embed_rules.py makes the same.
FRAME = (
    "<|im_start|>system\n{instruction}<|im_end|>\n<|im_start|>user\n{image}{text}<|im_end|>\n"
    "<|im_start|>assistant\n<|endoftext|>"
)
# Qwen3-VL-Embedding's (its qwen3_vl_embedding.py: the chat template with add_generation_prompt, no <|endoftext|>).
QWEN3_VL_FRAME = (
    "<|im_start|>system\n{instruction}<|im_end|>\n<|im_start|>user\n{image}{text}<|im_end|>\n<|im_start|>assistant\n"
)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
DEFAULT_INSTRUCTION = "You are a helpful assistant."
QWEN3_VL_INSTRUCTION = "Represent the user's input."
KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# qwen3_vl_embedding.py's MIN_PIXELS, MAX_PIXELS: the sizes it resizes every image to, whatever the checkpoint says.
QWEN3_VL_PIXELS = (4 * 32 * 32, 1800 * 32 * 32)
# transformers' class-name prefix per kind.
PREFIXES = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}


def _vision_config(kind: str) -> dict:
    common = dict(
        depth=3, num_heads=4, patch_size=14, temporal_patch_size=2, spatial_merge_size=2, initializer_range=0.15
    )
    if kind == "qwen2_vl":
        return dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2)
    if kind == "qwen3_vl":
        # 16-pixel patches, a 4 x 4 learned position grid (resampled to every image), DeepStack from blocks 0 and 1.
        return dict(
            common,
            patch_size=16,
            hidden_size=32,
            intermediate_size=48,
            out_hidden_size=64,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        )
    return dict(
        common, hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]
    )


def build_tiny_qwen_vl(
    tmp_dir: Path | str, kind: str = "qwen2_vl", seed: int = 0, name: str = "", tied: bool = False
) -> Path:
    """A random *ForConditionalGeneration directory of `kind` (qwen2_vl, qwen2_5_vl or qwen3_vl) with its processor
    (Qwen2VLImageProcessor: images between 56x56 and 168x168 pixels kept at their size when multiples of 28; Qwen3-VL:
    64x64 to 192x192, multiples of 32). A `name` containing "reranker" makes a Qwen3-VL-Reranker-style directory
    (the tokenizer has "yes" and "no"); `tied`: the LM head is the token embeddings (Qwen3-VL-2B's), which the
    checkpoint then leaves out."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(tmp_dir) / (name or f"tiny-{kind}")
    if (out / "config.json").exists():
        return out
    tokenizer = _qwen_tokenizer(out, ("yes", "no") if "reranker" in name else ())
    prefix = PREFIXES[kind]
    config_class = getattr(transformers, f"{prefix}Config")
    # Qwen3-VL: its decoder's head size named (Qwen3's default is 128), one layer past DeepStack's two.
    text = qwen_text_config(tokenizer, **({"head_dim": 16, "num_hidden_layers": 3} if kind == "qwen3_vl" else {}))
    # Tied as Qwen3-VL-2B's config.json ties: at the top (what transformers reads) and in text_config.
    ties = {"tie_word_embeddings": True} if tied else {}
    text.update(ties)
    config = config_class(
        text_config=text, vision_config=_vision_config(kind), **ties, **qwen_vision_token_ids(tokenizer)
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    _perturb(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    # The image processor alone: Qwen2VLProcessor also wants a video processor, which needs torchvision.
    if kind == "qwen3_vl":
        # Qwen3-VL's: 16-pixel patches (32-pixel merge blocks), mean and std 0.5.
        images = Qwen2VLImageProcessorPil(
            patch_size=16, min_pixels=64 * 64, max_pixels=192 * 192, image_mean=[0.5] * 3, image_std=[0.5] * 3
        )
    else:
        images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=168 * 168)
    images.save_pretrained(str(out))
    return out


def load_reference(model_dir: Path, pixels: tuple[int, int] = QWEN3_VL_PIXELS):
    """(transformers' model, its tokenizer, its image processor), float32 on CPU. Qwen3-VL's image processor sizes
    images as Qwen3-VL-Embedding's library does (qwen_vl_utils' smart_resize between QWEN3_VL_PIXELS, then the
    processor without resizing: the same as the processor given those bounds), not as the checkpoint's file says;
    `pixels`: other bounds (Qwen3-VL-Reranker's script's)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype="float32").eval()
    bounds = {}
    if model.config.model_type == "qwen3_vl":
        bounds = dict(zip(("min_pixels", "max_pixels"), pixels, strict=True))
    return (
        model,
        AutoTokenizer.from_pretrained(str(model_dir)),
        Qwen2VLImageProcessorPil.from_pretrained(str(model_dir), **bounds),
    )


def framed(text: str = "", image: bool = False, instruction: str | None = None, kind: str = "qwen2_vl") -> str:
    """The kind's frame (GME's; Qwen3-VL-Embedding's for qwen3_vl), its default instruction unless one is given."""
    if kind == "qwen3_vl":
        frame, instruction = QWEN3_VL_FRAME, instruction or QWEN3_VL_INSTRUCTION
    else:
        frame, instruction = FRAME, instruction or DEFAULT_INSTRUCTION
    return frame.format(instruction=instruction, image=IMAGE if image else "", text=text)


def reference_inputs(reference, text: str = "", image=None, instruction: str | None = None) -> dict:
    """One framed input as Qwen2VLProcessor makes it: the image processor's pixel rows and grid, the image's one
    `<|image_pad|>` repeated t * h * w / merge**2 times, the text tokenized whole."""
    prompt = framed(text, image is not None, instruction, reference[0].config.model_type)
    return processed_inputs(reference, prompt, image)


def processed_inputs(reference, prompt: str, image=None) -> dict:
    """A rendered prompt holding at most one image (its one `<|image_pad|>`) as the processor makes its inputs."""
    import torch

    _, tokenizer, images = reference
    batch: dict = {}
    if image is not None:
        batch = dict(images(images=[image], return_tensors="pt"))
        count = int(batch["image_grid_thw"][0].prod()) // images.merge_size**2
        prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * count)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    batch.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    if image is not None:
        batch["mm_token_type_ids"] = (ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).int()
    return batch


def reference_embedding(reference, text: str = "", image=None, instruction: str | None = None):
    """([hidden] float32, its inputs): one framed input through the checkpoint's inner model (Qwen2VLModel /
    Qwen2_5_VLModel, which computes M-RoPE from the grid), the last token's state, L2-normalized."""
    import torch

    batch = reference_inputs(reference, text, image, instruction)
    model = reference[0]
    with torch.no_grad():
        hidden = model.model(**batch).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1), batch
