"""What a model's HF image processor does, read once from preprocessor_config.json (at start-up, not per request).

The defaults and key handling follow transformers 5.23's PIL processors (CLIPImageProcessorPil,
SiglipImageProcessorPil, Siglip2ImageProcessorPil, Qwen2VLImageProcessorPil); a "Fast" (torchvision) type is
served as its PIL twin. The patch size comes from the file, else (CLIP/SigLIP) from config.json's vision_config.
"""

# A bad key of any type is a ValueError: start-up reports every configuration error the same way.

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 28 * 28 * 1280
IDEFICS3_TILE = 364
# PIL's resampling filters by number: NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING.
RESAMPLE_FILTERS = range(6)

_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip": {
        "size": {"shortest_edge": 224},
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
    },
    "siglip": {
        "size": {"height": 224, "width": 224},
        "do_center_crop": False,
        "crop_size": None,
        "image_mean": HALF,
        "image_std": HALF,
    },
    "qwen2_vl": {
        "size": {"shortest_edge": QWEN2_VL_MIN_PIXELS, "longest_edge": QWEN2_VL_MAX_PIXELS},
        "do_center_crop": False,
        "crop_size": None,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    },
    "siglip2": {"resample": 2, "image_mean": HALF, "image_std": HALF, "patch_size": 16, "max_num_patches": 256},
    "idefics3": {
        "size": {"longest_edge": 4 * IDEFICS3_TILE},
        "max_image_size": {"longest_edge": IDEFICS3_TILE},
        "resample": 1,
        "image_mean": HALF,
        "image_std": HALF,
        "do_image_splitting": True,
    },
}
_TYPES = {
    "CLIPImageProcessor": "clip",
    "CLIPFeatureExtractor": "clip",
    "SiglipImageProcessor": "siglip",
    "Qwen2VLImageProcessor": "qwen2_vl",
    "Siglip2ImageProcessor": "siglip2",
    "Idefics3ImageProcessor": "idefics3",
}
# Keys that change nothing in the pixel values of one RGB image.
_INERT = {
    "image_processor_type",
    "feature_extractor_type",
    "processor_class",
    "default_to_square",
    "do_pad",
    "pad_size",
    "return_tensors",
    "data_format",
    "input_data_format",
    "device",
    "disable_grouping",
    "image_seq_length",
    "return_row_col_info",
}


@dataclass(frozen=True)
class ImageProcessing:
    """One image processor's settings. `layout` is "chw" (CLIP/SigLIP: [3, H, W] then conv patches), "qwen2_vl"
    (smart_resize, then merge-ordered temporal patches), "siglip2" (resized to at most max_num_patches, then
    (row, column, channel) patches) or "idefics3" (ColModernVBERT: tiles of tile_size squared and the whole image
    at that size, images/idefics3.py). `resize` is ("shortest_edge", n) or ("shortest_longest", short, long) or
    ("fixed", height, width) or ("pixels", min_pixels, max_pixels) or ("longest_edge", n); None when do_resize is
    off or the layout sizes the image itself (SigLIP2). `crop` is (height, width) or None."""

    layout: str
    resize: tuple[str, ...] | None
    resample: int
    crop: tuple[int, int] | None
    rescale_factor: float | None
    image_mean: tuple[float, float, float] | None
    image_std: tuple[float, float, float] | None
    patch_size: int
    temporal_patch_size: int = 1
    merge_size: int = 1
    max_num_patches: int = 0
    # Idefics3: max_image_size's longest_edge (every tile's side), and do_image_splitting.
    tile_size: int = 0
    split_tiles: bool = False


def read_image_processing(model_dir: Path) -> ImageProcessing | None:
    """The model's image preprocessing, or None when it ships no preprocessor_config.json."""
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return processing_from_dict(raw, path, _model_patch_size(Path(model_dir) / "config.json"))


def processing_from_dict(raw: dict[str, Any], path: Path | str, model_patch: int | None = None) -> ImageProcessing:
    """`raw` is a preprocessor_config.json's content; ValueError naming `path` and the key it cannot reproduce."""
    name = raw.get("image_processor_type") or raw.get("feature_extractor_type") or ""
    base = name.removesuffix("Pil").removesuffix("Fast")
    if base not in _TYPES:
        raise ValueError(f"{path}: image_processor_type {name!r} is not supported; supported: {sorted(_TYPES)}")
    kind = _TYPES[base]
    _refuse_unknown(raw, path, kind)
    get = _Getter(raw, _DEFAULTS[kind], path)
    # Idefics3 pads every image to the batch's largest, and all of its images are tile_size squared.
    if get.flag("do_pad", False) and kind not in ("qwen2_vl", "idefics3"):
        raise ValueError(f"{path}: do_pad is not supported")
    # do_convert_rgb false (or null) is read but every image is served as RGB: for an RGB input that is the same
    # pixels, and any other mode would give HF a tensor without 3 channels (ColPali's processor forces it on).
    get.flag("do_convert_rgb", True)
    patch = get.number("patch_size", model_patch)
    if kind == "qwen2_vl":
        return _qwen2_vl(get, path, patch)
    if kind == "idefics3":
        return _idefics3(get, path, patch)
    if kind == "siglip2":
        if not get.flag("do_resize", True):
            raise ValueError(f"{path}: do_resize false is not supported for SigLIP2 (max_num_patches would not hold)")
        return ImageProcessing(
            "siglip2",
            None,
            get.resample(),
            None,
            get.rescale(),
            *get.normalize(),
            patch_size=patch,
            max_num_patches=get.number("max_num_patches"),
        )
    resize = _resize_rule(get, path) if get.flag("do_resize", True) else None
    crop = _size_pair(get.required("crop_size"), path, "crop_size") if get.flag("do_center_crop") else None
    return ImageProcessing("chw", resize, get.resample(), crop, get.rescale(), *get.normalize(), patch_size=patch)


def _qwen2_vl(get: _Getter, path: Path | str, patch: int) -> ImageProcessing:
    if not get.flag("do_resize", True):
        raise ValueError(
            f"{path}: do_resize false is not supported for Qwen2-VL (sides must be multiples of "
            f"patch_size * merge_size)"
        )
    size = get.required("size")  # top-level min_pixels / max_pixels win, as in Qwen2VLImageProcessor
    if not isinstance(size, dict):
        raise ValueError(f"{path}: size {size!r} is not supported for Qwen2-VL; give shortest_edge and longest_edge")
    low = get.keys.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or QWEN2_VL_MIN_PIXELS
    high = get.keys.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or QWEN2_VL_MAX_PIXELS
    if not (isinstance(low, int) and isinstance(high, int) and 0 < low <= high):
        raise ValueError(f"{path}: min_pixels {low} / max_pixels {high} must satisfy 0 < min <= max")
    return ImageProcessing(
        "qwen2_vl",
        ("pixels", low, high),
        get.resample(),
        None,
        get.rescale(),
        *get.normalize(),
        patch_size=patch,
        temporal_patch_size=get.number("temporal_patch_size"),
        merge_size=get.number("merge_size"),
    )


def _idefics3(get: _Getter, path: Path | str, patch: int) -> ImageProcessing:
    tile = get.required("max_image_size")
    if not (isinstance(tile, dict) and set(tile) == {"longest_edge"}):
        raise ValueError(f"{path}: max_image_size {tile!r} is not supported; give longest_edge")
    resize = None
    if get.flag("do_resize", True):
        size = get.required("size")
        if isinstance(size, dict) and set(size) == {"longest_edge"}:
            resize = ("longest_edge", int(size["longest_edge"]))
        elif isinstance(size, dict) and set(size) == {"height", "width"}:
            resize = ("fixed", int(size["height"]), int(size["width"]))
        else:
            raise ValueError(f"{path}: size {size!r} is not supported for Idefics3; give longest_edge")
    return ImageProcessing(
        "idefics3",
        resize,
        get.resample(),
        None,
        get.rescale(),
        *get.normalize(),
        patch_size=patch,
        tile_size=int(tile["longest_edge"]),
        split_tiles=get.flag("do_image_splitting", True),
    )


def _resize_rule(get: _Getter, path: Path | str) -> tuple[str, ...]:
    size = get.required("size")
    if isinstance(size, int):
        size = {"shortest_edge": size}  # default_to_square is False in these processors
    elif isinstance(size, (list, tuple)) and len(size) == 2:
        size = {"height": size[0], "width": size[1]}
    if not isinstance(size, dict):
        raise ValueError(f"{path}: size {size!r} is not a size this server can reproduce")
    if get.flag("use_square_size") and "shortest_edge" in size:  # CLIP's Kosmos-2 compatibility switch
        size = {"height": size["shortest_edge"], "width": size["shortest_edge"]}
    if set(size) == {"shortest_edge", "longest_edge"}:
        return ("shortest_longest", int(size["shortest_edge"]), int(size["longest_edge"]))
    if set(size) == {"shortest_edge"}:
        return ("shortest_edge", int(size["shortest_edge"]))
    if set(size) == {"height", "width"}:
        return ("fixed", int(size["height"]), int(size["width"]))
    raise ValueError(
        f"{path}: size {size!r} is not supported; use shortest_edge (optionally with longest_edge) or height and width"
    )


def _size_pair(size: Any, path: Path | str, key: str) -> tuple[int, int]:
    if isinstance(size, int):
        return (size, size)
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return (int(size[0]), int(size[1]))
    if isinstance(size, dict) and set(size) == {"height", "width"}:
        return (int(size["height"]), int(size["width"]))
    raise ValueError(f"{path}: {key} {size!r} is not supported; give height and width")


def _refuse_unknown(keys: dict[str, Any], path: Path | str, kind: str) -> None:
    known = (
        _INERT
        | set(_DEFAULTS[kind])
        | {
            "do_resize",
            "size",
            "resample",
            "do_center_crop",
            "crop_size",
            "do_rescale",
            "rescale_factor",
            "do_normalize",
            "image_mean",
            "image_std",
            "do_convert_rgb",
            "use_square_size",
            "patch_size",
        }
    )
    if kind == "qwen2_vl":
        known |= {"min_pixels", "max_pixels"}
    for key, value in keys.items():
        if key not in known and ((key.startswith("do_") and value is True) or key == "auto_map"):
            raise ValueError(f"{path}: {key} is not supported by this server's image preprocessing")


def _model_patch_size(config: Path) -> int | None:
    """The vision tower's patch size from config.json (CLIP/SigLIP: vision_config; ColPali: vlm_config's)."""
    if not config.is_file():
        return None
    found = [json.loads(config.read_text())]
    while found:
        node = found.pop(0)
        vision = node.get("vision_config")
        if isinstance(vision, dict) and "patch_size" in vision:
            return int(vision["patch_size"])
        found.extend(v for v in node.values() if isinstance(v, dict))
    return None


class _Getter:
    """Reads keys with the processor class's defaults; ValueError naming the file for a bad value. A key given as
    null stays None, as transformers 5.23 keeps it: a null flag is off, a null value is refused."""

    def __init__(self, keys: dict[str, Any], defaults: dict[str, Any], path: Path | str) -> None:
        self.keys, self.defaults, self.path = keys, defaults, path

    def value(self, key: str, fallback: Any = None) -> Any:
        return self.keys[key] if key in self.keys else self.defaults.get(key, fallback)

    def required(self, key: str, fallback: Any = None) -> Any:
        found = self.value(key, fallback)
        if found is None:
            where = ", and config.json has no vision_config.patch_size" if key == "patch_size" else ""
            raise ValueError(f"{self.path}: {key} is missing or null{where}")
        return found

    def number(self, key: str, fallback: Any = None) -> int:
        found = self.required(key, fallback)
        if isinstance(found, bool) or not isinstance(found, int) or found < 1:
            raise ValueError(f"{self.path}: {key} must be a positive integer, got {found!r}")
        return found

    def flag(self, key: str, fallback: bool = False) -> bool:
        found = self.value(key, fallback)
        if found is None:
            return False
        if not isinstance(found, bool):
            raise ValueError(f"{self.path}: {key} must be true or false, got {found!r}")
        return found

    def resample(self) -> int:
        found = self.required("resample", 3)  # BICUBIC but in SigLIP2; HF refuses a null one when resizing
        if not isinstance(found, int) or found not in RESAMPLE_FILTERS:
            raise ValueError(f"{self.path}: resample {found!r} is not one of PIL's filters 0-5")
        return found

    def rescale(self) -> float | None:
        return float(self.required("rescale_factor", 1 / 255)) if self.flag("do_rescale", True) else None

    def normalize(self) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        if not self.flag("do_normalize", True):
            return None, None
        return self._triple("image_mean"), self._triple("image_std")

    def _triple(self, key: str) -> tuple[float, float, float]:
        found = self.required(key)
        values = [found] * 3 if isinstance(found, (int, float)) else list(found)
        if len(values) != 3:
            raise ValueError(f"{self.path}: {key} must have 3 values (RGB), got {found!r}")
        return (float(values[0]), float(values[1]), float(values[2]))
