"""Small random-weight vision-language retrievers for tests: ColQwen2 (Qwen2-VL) and ColPali (PaliGemma).

Each builder saves a directory transformers loads as the model and its processor (`from_pretrained`): config,
float32 safetensors, a byte-level BPE tokenizer trained on stdlib docstrings (tests/helpers/seq2seq_models.py)
with the processor's special tokens added, and the image processor's preprocessor_config.json. Norm weights
and biases are made random (they start at 1 and 0) so that a tensor loaded into the wrong place shows.
Images are made in the tests (`page_image`): numpy noise with a gradient, encoded as PNG or JPEG bytes.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from tests.helpers.seq2seq_models import _bpe_vocab_and_merges, _perturb, _vocab_size

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Heights x widths in pixels, multiples of Qwen2-VL's 28 (patch 14 x merge 2), so the processor keeps the size:
# wide, square and tall pages of several sizes (their M-RoPE grids differ in rows, columns and which is larger).
COLQWEN2_SIZES = ((56, 84), (84, 112), (56, 56), (112, 56), (56, 112))


def page_image(height: int, width: int, seed: int, fmt: str = "PNG") -> bytes:
    """An RGB image of noise over a gradient, encoded as `fmt` (PNG or JPEG) bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 160, width)[None, :, None] + np.linspace(0, 80, height)[:, None, None]
    pixels = np.clip(gradient + rng.integers(0, 96, (height, width, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format=fmt)
    return out.getvalue()


def _qwen_tokenizer(out: Path, tokens: tuple[str, ...] = ()):
    """Qwen2Tokenizer over the trained byte-level BPE, Qwen2-VL's special tokens added, and `tokens` as ordinary
    added tokens (the trained vocabulary lacks "yes" and "no"); pads with <|endoftext|>."""
    from transformers import Qwen2Tokenizer

    vocab, merges = _bpe_vocab_and_merges()
    tokenizer = Qwen2Tokenizer(
        vocab=dict(vocab),
        merges=list(merges),
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
        padding_side="right",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    tokenizer.add_tokens(list(tokens))
    tokenizer.save_pretrained(str(out))
    return tokenizer


def qwen_text_config(tokenizer, **overrides) -> dict:
    """A tiny Qwen2-VL language model's config (M-RoPE sections [2, 3, 3] of its 8 rotary frequencies)."""
    text = dict(
        vocab_size=_vocab_size(len(tokenizer)),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        initializer_range=0.15,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    text.update(overrides)
    return text


def qwen_vision_token_ids(tokenizer) -> dict:
    """A Qwen2-VL config's image, video and vision start/end token ids from the tokenizer."""
    return {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }


# The towers of ColQwen2 (Qwen2-VL's) and ColQwen2.5 (Qwen2.5-VL's: windows of 56 pixels, 2 x 2 merge blocks, so
# the pages hold several, some cut short; block 1 attends whole frames).
COLQWEN_VISION = {
    "qwen2_vl": dict(embed_dim=32, hidden_size=64, mlp_ratio=2),
    "qwen2_5_vl": dict(
        hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]
    ),
}


def _colqwen2_config(tokenizer, embedding_dim: int, kind: str = "qwen2_vl", **text_overrides):
    from transformers import ColQwen2Config

    vision = dict(
        depth=2,
        num_heads=4,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
        initializer_range=0.15,
        **COLQWEN_VISION[kind],
    )
    text = qwen_text_config(tokenizer, **text_overrides)
    vlm = dict(model_type=kind, text_config=text, vision_config=vision, **qwen_vision_token_ids(tokenizer))
    return ColQwen2Config(vlm_config=vlm, embedding_dim=embedding_dim, initializer_range=0.15)


def build_tiny_colqwen2(
    tmp_dir: Path | str, name: str = "tiny-colqwen2", seed: int = 0, embedding_dim: int = 24, kind: str = "qwen2_vl"
) -> Path:
    """A random ColQwen2ForRetrieval directory with its ColQwen2Processor (Qwen2VLImageProcessor: 14-pixel
    patches, merge 2, images between 56x56 and 112x112 pixels kept at their size when multiples of 28); `kind`
    is the model it nests: qwen2_vl (ColQwen2) or qwen2_5_vl (ColQwen2.5)."""
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(tmp_dir) / name
    if (out / "config.json").exists():
        return out
    tokenizer = _qwen_tokenizer(out)
    config = _colqwen2_config(tokenizer, embedding_dim, kind)
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    processor = ColQwen2Processor(image_processor=images, tokenizer=tokenizer)
    return save_retriever(out, ColQwen2ForRetrieval, config, seed, processor)


GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
# A 28x28 SigLIP input in 14-pixel patches: 4 image tokens per page.
COLPALI_IMAGE_SIZE = 28


def _gemma_tokenizer(out: Path):
    """GemmaTokenizer (BPE over "▁"-joined text, byte fallback) over a vocabulary trained on the docstrings."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    from tests.helpers.seq2seq_models import _training_texts

    trainer_tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tokenizer.normalizer = normalizers.Replace(" ", "▁")
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(GEMMA_SPECIAL_TOKENS), show_progress=False)
    trainer_tokenizer.train_from_iterator(_training_texts(), trainer)
    state = json.loads(trainer_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = GemmaTokenizer(vocab=state["vocab"], merges=merges, model_max_length=512, padding_side="right")
    tokenizer.save_pretrained(str(out))
    return tokenizer


def tiny_siglip_vision(image_size: int, patch_size: int) -> dict:
    """A SigLIP vision tower's config without its pooling head (PaliGemma's, ModernVBERT's), two small layers."""
    return dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        vision_use_head=False,
    )


def _colpali_config(tokenizer, embedding_dim: int):
    from transformers import ColPaliConfig

    vocab = _vocab_size(len(tokenizer) + 1)
    text = dict(
        model_type="gemma",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        initializer_range=0.15,
        hidden_activation="gelu_pytorch_tanh",
    )
    vision = tiny_siglip_vision(COLPALI_IMAGE_SIZE, 14)
    vlm = dict(
        model_type="paligemma",
        text_config=text,
        vision_config=vision,
        projection_dim=64,
        hidden_size=64,
        vocab_size=vocab,
        image_token_index=len(tokenizer),
    )
    return ColPaliConfig(vlm_config=vlm, embedding_dim=embedding_dim, initializer_range=0.15)


def build_tiny_colpali(tmp_dir: Path | str, name: str = "tiny-colpali", seed: int = 0, embedding_dim: int = 24) -> Path:
    """A random ColPaliForRetrieval directory with its ColPaliProcessor (SiglipImageProcessor at 28x28)."""
    from transformers import ColPaliForRetrieval, ColPaliProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    out = Path(tmp_dir) / name
    if (out / "config.json").exists():
        return out
    tokenizer = _gemma_tokenizer(out)
    images = SiglipImageProcessorPil(size={"height": COLPALI_IMAGE_SIZE, "width": COLPALI_IMAGE_SIZE})
    images.image_seq_length = (COLPALI_IMAGE_SIZE // 14) ** 2
    # The processor adds its <image> token (the next id) and PaliGemma's location tokens to the tokenizer.
    processor = ColPaliProcessor(image_processor=images, tokenizer=tokenizer)
    config = _colpali_config(processor.tokenizer, embedding_dim)
    config.vlm_config.image_token_id = processor.image_token_id
    return save_retriever(out, ColPaliForRetrieval, config, seed, processor)


def save_retriever(out: Path, model_class, config, seed: int, processor) -> Path:
    """Seeded random weights of `model_class(config)`, norms and biases perturbed, saved in `out` with the
    processor; transformers 5 keeps the image processor's settings in processor_config.json, hub models (and our
    engine/inputs/images) in preprocessor_config.json: both are written."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config).eval()
    _perturb(model, seed)
    model.save_pretrained(str(out), safe_serialization=True)
    processor.save_pretrained(str(out))
    processor.image_processor.save_pretrained(str(out))
    return out


def load_ours(model_dir: Path):
    """(our model, its projection head, whether its attention is causal) on CPU in float32."""
    from types import SimpleNamespace

    import torch

    from embedserv.models import registry
    from embedserv.models.heads.vision_retrieval import build_projection_head
    from embedserv.models.loading.checkpoint import checkpoint_files
    from embedserv.models.loading.hf_config import read_hf_config
    from embedserv.models.loading.weights import build_model

    cpu = torch.device("cpu")
    hf_config = read_hf_config(model_dir)
    family = registry.lookup(hf_config.model_type)
    files = checkpoint_files(model_dir)
    model = build_model(family, hf_config, files, cpu, torch.float32)
    spec = SimpleNamespace(files=files, model_dir=model_dir, device=cpu, dtype=torch.float32)
    causal = registry.is_causal(family.text_config(hf_config), family)
    return model, build_projection_head(spec, False), causal


def packed_vectors(model, head, causal: bool, items, pad_tokens: int = 0, pad_rows: int = 0) -> list:
    """Our token vectors per item (ids, patch rows or None, grid) from one packed pass under the naive backend,
    with `pad_tokens` / `pad_rows` zero rows after the real ones, as the input builder pads them on CPU; the
    vision tower attends each image's frames apart, as the input builder's image plan makes them."""
    import torch

    from embedserv.attention.backends.naive import NaiveBackend
    from embedserv.attention.metadata import build_common_metadata
    from embedserv.forward_context import set_forward_context
    from embedserv.models.mrope import packed_mrope_positions
    from embedserv.worker.layer_routes import forward_context_for

    lens = [len(ids) for ids, _, _ in items]
    ids = torch.cat([ids for ids, _, _ in items] + [torch.zeros(pad_tokens, dtype=torch.long)])
    if model.mrope is None:
        positions = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(pad_tokens, dtype=torch.long)])
    else:
        # M-RoPE (ColQwen2): [3, tokens], each item from its own 0 (as the input builder computes them).
        packed = packed_mrope_positions(
            [(i.tolist(), (g,) if r is not None else (), 0) for i, r, g in items], model.mrope
        )
        positions = torch.nn.functional.pad(torch.from_numpy(packed), (0, pad_tokens))
    images = [(rows, grid) for _, rows, grid in items if rows is not None]
    backend, vision, windows, extra = NaiveBackend(), None, None, {}
    if images:
        rows = torch.cat([r for r, _ in images] + [torch.zeros(pad_rows, images[0][0].shape[1])])
        extra = {"pixel_values": rows, "image_grids": tuple(g for _, g in images)}
        vision, windows = vision_metadata(backend, model, [g for _, g in images], [len(r) for r, _ in images])
    text = backend.build_metadata(build_common_metadata(np.array(lens), causal))
    context = forward_context_for(model, backend, text, encoder_metadata=vision, window_metadata=windows)
    with torch.inference_mode(), set_forward_context(context):
        hidden = model(ids, positions + model.position_offset, **extra)
        vectors = head(hidden[: sum(lens)])
    return list(vectors.split(lens))


def vision_metadata(backend, model, grids, row_counts):
    """(frames', windows' or None) metadata of a Qwen2-VL-style tower's images, as the input builder's image plan
    makes them: each frame attended apart, and a windowed tower's (Qwen2.5-VL's) windows."""
    from embedserv.attention.metadata import build_common_metadata
    from embedserv.worker.image_inputs import frame_lengths

    vision = backend.build_metadata(build_common_metadata(frame_lengths(row_counts, grids), False))
    windows = None
    if getattr(model, "vision_windows", None) is not None:
        windows = backend.build_metadata(build_common_metadata(model.vision_windows.lengths(grids), False))
    return vision, windows


def colqwen2_reference(model, input_ids, attention_mask, pixel_values=None, image_grid_thw=None):
    """[batch, tokens, dim] token vectors of a ColQwen2ForRetrieval checkpoint as colpali-engine frames them:
    the inner Qwen2-VL model (`model.vlm`, a Qwen2VLModel) given the ids, pixels and grids (so it computes
    M-RoPE positions), then the projection, L2 norm and attention mask, as ColQwen2ForRetrieval finishes. Takes
    a ColQwen2Processor's batch (pixel rows padded per image)."""
    import torch

    kwargs = {}
    if pixel_values is not None:
        counts = image_grid_thw.prod(dim=-1)
        rows = pixel_values[torch.arange(pixel_values.shape[1])[None] < counts[:, None]]
        image_token = model.config.vlm_config.image_token_id
        types = (input_ids == image_token).int()
        kwargs = {"pixel_values": rows, "image_grid_thw": image_grid_thw, "mm_token_type_ids": types}
    with torch.no_grad():
        hidden = model.vlm(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        vectors = model.embedding_proj_layer(hidden)
    return vectors / vectors.norm(dim=-1, keepdim=True) * attention_mask.unsqueeze(-1)


def hub_layout_copy(model_dir: Path, out: Path, rename, extra: dict[str, tuple[int, ...]]) -> Path:
    """A copy of a model directory whose checkpoint names are `rename(name)` (the layout older transformers
    saved, as hub checkpoints have it), plus `extra` tensors of the given shapes (heads a retriever leaves
    unused)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    tensors = {rename(name): tensor for name, tensor in load_file(str(model_dir / "model.safetensors")).items()}
    tensors.update({name: torch.zeros(shape) for name, shape in extra.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def same_parameters(a, b) -> bool:
    import torch

    first, second = dict(a.named_parameters()), dict(b.named_parameters())
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
