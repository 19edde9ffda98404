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
# The checkpoints' chat templates, which transformers does not ship (hub repositories' chat_template.json):
# Qwen2-VL-Instruct's (Qwen2.5-VL's is the same), and Qwen3-VL-Instruct's system, user and assistant branches (its
# tool branches left out: no message here has tools). A user message's content list renders each image as IMAGE and
# each text as it is, in order.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_VL_CHAT_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {%- for content in messages[0].content %}
            {%- if 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
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
    return processed_inputs(reference, prompt, () if image is None else (image,))


def processed_inputs(reference, prompt: str, images=()) -> dict:
    """A rendered prompt holding one `<|image_pad|>` per image of `images`, in order, as the processor makes its
    inputs: each pad repeated t * h * w / merge**2 times for its image's grid."""
    import torch

    _, tokenizer, processor = reference
    batch: dict = {}
    if images:
        batch = dict(processor(images=list(images), return_tensors="pt"))
        pieces = prompt.split("<|image_pad|>")
        assert len(pieces) == len(images) + 1, "one <|image_pad|> per image"
        counts = [int(grid.prod()) // processor.merge_size**2 for grid in batch["image_grid_thw"]]
        prompt = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:], strict=True))
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    batch.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    if images:
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


def processor(reference):
    """The checkpoint's processor (Qwen2VLProcessor; Qwen3VLProcessor for qwen3_vl) over the reference's tokenizer and
    image processor, with the kind's chat template and without a video processor (which needs torchvision)."""
    import transformers

    model, tokenizer, images = reference
    qwen3 = model.config.model_type == "qwen3_vl"
    base = transformers.Qwen3VLProcessor if qwen3 else transformers.Qwen2VLProcessor

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    template = QWEN3_VL_CHAT_TEMPLATE if qwen3 else QWEN2_VL_CHAT_TEMPLATE
    return ImagesOnly(image_processor=images, tokenizer=tokenizer, video_processor=None, chat_template=template)


def reference_interleaved(reference, parts: list, instruction: str | None = None) -> tuple:
    """([hidden] float32, its inputs): one input of texts (str) and PIL images in order, as the embedders make it:
    the processor's chat template over a system message (the kind's instruction) and one user message whose
    content lists the parts (GME's gme_inference.py and Qwen3-VL-Embedding's qwen3_vl_embedding.py), GME's
    `<|endoftext|>` after it, then the processor on that text and the images; through the inner model, the last
    token's state, L2-normalized."""
    import torch

    model = reference[0]
    qwen3 = model.config.model_type == "qwen3_vl"
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]
    system = instruction or (QWEN3_VL_INSTRUCTION if qwen3 else DEFAULT_INSTRUCTION)
    messages = [
        {"role": "system", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": content},
    ]
    make = processor(reference)
    text = make.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text += "" if qwen3 else "<|endoftext|>"
    images = [p for p in parts if not isinstance(p, str)] or None
    batch = dict(make(text=[text], images=images, return_tensors="pt"))
    with torch.no_grad():
        hidden = model.model(**batch).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1), batch
