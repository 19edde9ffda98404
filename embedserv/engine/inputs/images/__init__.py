"""Image inputs: decode encoded bytes under limits, then preprocess exactly as the model's HF image processor does.

Torch-free (numpy and Pillow only). Everything here is blocking CPU work: the front end's caller runs it in the
tokenizer/worker pool, never on the event loop.

- `decode.py`: `decode_image` checks size in bytes, the format by its magic bytes (PNG, JPEG, WebP), the pixel count
  from the header before anything is decoded, then decodes fully and converts to RGB as HF's `convert_to_rgb` does.
  Every refusal is an `ImageError` (INVALID_ARGUMENT / 400) naming the input.
- `processing.py`: `ImageProcessing`, read once at start-up from `preprocessor_config.json`; what cannot be
  reproduced is refused there with a ValueError naming the file and key.
- `pixels.py`: `pixel_values` (the processor's output for one image), `patch_rows` (a conv-patch embedding's
  input rows) and `prepare_image` (all of it: what the vision tower takes, and its grid).

Processors reproduced (transformers 5.23's PIL backends; a "Fast" type is served as its PIL twin): CLIP, SigLIP
(also fixed-size SigLIP2 checkpoints, which ship it; PaliGemma / ColPali), SigLIP2's NaFlex processor
(max_num_patches), Qwen2-VL (ColQwen2) and Idefics3 (ColModernVBERT: tiles and a global image, idefics3.py).
"""

from embedserv.engine.inputs.images.decode import (
    MAX_ASPECT_RATIO,
    MIN_SIDE,
    ImageError,
    ImageLimits,
    decode_image,
)
from embedserv.engine.inputs.images.pixels import patch_rows, pixel_values, prepare_image
from embedserv.engine.inputs.images.processing import ImageProcessing, read_image_processing

__all__ = [
    "MAX_ASPECT_RATIO",
    "MIN_SIDE",
    "ImageError",
    "ImageLimits",
    "ImageProcessing",
    "decode_image",
    "patch_rows",
    "pixel_values",
    "prepare_image",
    "read_image_processing",
]
