"""A small random-weight ColModernVBERT (transformers' ColModernVBertForRetrieval) for tests.

`build_tiny_colmodernvbert` saves a directory transformers loads as the model and its ColModernVBertProcessor:
config, float32 safetensors, a byte-level BPE tokenizer as ModernBERT's is (BartTokenizer over the trained
vocabulary, tests/helpers/seq2seq_models.py: <s> ... </s> around every text, "\n" a token of its own) with
ModernVBERT's added tokens (`<|begin_of_text|>`, `<global-img>`, `<row_r_col_c>`) and the
processor's own, and Idefics3's image processor in preprocessor_config.json: pages resized to a longest edge of
96 pixels, cut into 48x48 tiles (2x2, 2x1 or 1x2 and the global image) of 8-pixel patches, each frame's 6x6
patches pixel-shuffled by 2 into 9 image tokens. The text encoder is tests/helpers/modernbert_models' ModernBERT
(local layers see 8 tokens each side, far below a page's length). Norm weights and biases are perturbed so that
a tensor loaded into the wrong place shows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TILE = 48
PATCH = 8
SHUFFLE = 2
LONGEST_EDGE = 96
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SHUFFLE**2
ADDED_TOKENS = ["<|begin_of_text|>", "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def _config(tokenizer, image_token_id: int, embedding_dim: int):
    from transformers import ColModernVBertConfig

    from tests.helpers.modernbert_models import modernbert_config
    from tests.helpers.seq2seq_models import _vocab_size
    from tests.helpers.vision_language_models import tiny_siglip_vision

    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    ids.update(cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id)
    text = modernbert_config(_vocab_size(len(tokenizer)), **ids).to_dict()
    vlm = dict(
        model_type="modernvbert",
        text_config=text,
        vision_config=tiny_siglip_vision(TILE, PATCH),
        image_token_id=image_token_id,
        pixel_shuffle_factor=SHUFFLE,
        initializer_range=0.15,
    )
    return ColModernVBertConfig(vlm_config=vlm, embedding_dim=embedding_dim, initializer_range=0.15)


def build_tiny_colmodernvbert(
    tmp_dir: Path | str, name: str = "tiny-colmodernvbert", seed: int = 0, embedding_dim: int = 24
) -> Path:
    from transformers import ColModernVBertForRetrieval, ColModernVBertProcessor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tests.helpers.seq2seq_models import save_bart_tokenizer
    from tests.helpers.vision_language_models import save_retriever

    out = Path(tmp_dir) / name
    if (out / "config.json").exists():
        return out
    tokenizer = save_bart_tokenizer(out, model_max_length=512)
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}, resample=1
    )
    # The processor adds its image tokens to the tokenizer.
    processor = ColModernVBertProcessor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN)
    config = _config(processor.tokenizer, processor.image_token_id, embedding_dim)
    return save_retriever(out, ColModernVBertForRetrieval, config, seed, processor)


def unsplit_copy(model_dir: Path, out: Path) -> Path:
    """The same model whose image processor does not split pages (do_image_splitting false): one frame each."""
    shutil.copytree(model_dir, out)
    path = out / "preprocessor_config.json"
    settings = json.loads(path.read_text())
    settings["do_image_splitting"] = False
    path.write_text(json.dumps(settings))
    processor = out / "processor_config.json"
    saved = json.loads(processor.read_text())
    if isinstance(saved.get("image_processor"), dict):
        saved["image_processor"]["do_image_splitting"] = False
        processor.write_text(json.dumps(saved))
    return out
