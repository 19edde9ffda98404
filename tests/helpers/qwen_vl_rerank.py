"""The reference for Qwen3-VL-Reranker-style models (tests/helpers/qwen_vl_models.build_tiny_qwen_vl with a name
containing "reranker"): its scripts/qwen3_vl_reranker.py's messages for one (query, document) pair, rendered by
Qwen3-VL's chat template with add_generation_prompt, the image's pixel rows and grid from the image processor (the
checkpoint's own), then transformers' Qwen3VLForConditionalGeneration: sigmoid(logit("yes") - logit("no")) at the
last token. Images are sized as the script sizes them: qwen_vl_utils' resize between its PIXELS, then the processor
without resizing (load_reference(model_dir, PIXELS)).

Qwen3-VL's template is its chat_template.json reduced to what these messages reach (a system turn of text, a user
turn of text and image parts, no tools): each text part as it is, each image as
`<|vision_start|><|image_pad|><|vision_end|>`, nothing between parts, and `<|im_start|>assistant\\n` opened.
A prompt past `max_length` is cut as the script cuts it: its text tokens past the limit are dropped (special
tokens, the image's among them, are kept), the generation prompt's tokens kept whole.
"""

from __future__ import annotations

from tests.helpers.qwen_vl_models import processed_inputs

SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
# qwen3_vl_reranker.py's MIN_PIXELS, MAX_PIXELS: its qwen_vl_utils resize, whatever the checkpoint says.
PIXELS = (4 * 32 * 32, 1280 * 32 * 32)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- for content in message.content %}"
    "{%- if content.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GENERATION_PROMPT = "<|im_end|>\n<|im_start|>assistant\n"


def _side(text: str, image, prefix: str) -> list[dict]:
    """The script's format_mm_content: the prefix, then the image, then the text; "NULL" for neither."""
    parts = [{"type": "text", "text": prefix}]
    if not text and image is None:
        return [*parts, {"type": "text", "text": "NULL"}]
    if image is not None:
        parts.append({"type": "image", "image": image})
    if text:
        parts.append({"type": "text", "text": text})
    return parts


def messages(query: str, document: str, query_image=None, document_image=None, instruction: str | None = None):
    """The script's format_mm_instruction for one pair (images as PIL images)."""
    user = [{"type": "text", "text": "<Instruct>: " + (instruction or DEFAULT_INSTRUCTION)}]
    user += _side(query, query_image, "<Query>:") + _side(document, document_image, "\n<Document>:")
    return [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}, {"role": "user", "content": user}]


def reference_inputs(reference, pair: list[dict], max_length: int | None = None) -> dict:
    """The pair's rendered prompt as the processor makes its inputs, cut to `max_length` tokens as the script cuts."""
    import torch

    model, tokenizer, _ = reference
    prompt = tokenizer.apply_chat_template(
        pair, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    images = [part["image"] for message in pair for part in message["content"] if part["type"] == "image"]
    batch = processed_inputs(reference, prompt, images)
    ids = batch["input_ids"][0].tolist()
    if max_length is not None and len(ids) > max_length:
        tail = len(tokenizer(GENERATION_PROMPT, add_special_tokens=False)["input_ids"])
        ids = _cut(ids[:-tail], max_length - tail, set(tokenizer.all_special_ids)) + ids[-tail:]
        batch["input_ids"] = torch.tensor([ids])
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        if "mm_token_type_ids" in batch:
            batch["mm_token_type_ids"] = (batch["input_ids"] == model.config.image_token_id).int()
    return batch


def _cut(ids: list[int], max_length: int, special: set[int]) -> list[int]:
    """The script's truncate_tokens_optimized: every special token kept, and the first others that fit."""
    room, out = max_length - sum(i in special for i in ids), []
    for i in ids:
        if i in special or room > 0:
            room -= i not in special
            out.append(i)
    return out


def reference_logit(reference, pair: list[dict], max_length: int | None = None) -> tuple[float, list[int]]:
    """(logit("yes") - logit("no") at the pair's last token, its input ids)."""
    import torch

    model, tokenizer, _ = reference
    batch = reference_inputs(reference, pair, max_length)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    with torch.no_grad():
        logits = model(**batch).logits[0, -1]
    return float(logits[yes] - logits[no]), batch["input_ids"][0].tolist()
