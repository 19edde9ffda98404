"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLModel) as an embedder: Qwen2-VL's (qwen2_vl.py)
with Qwen2.5-VL's vision tower (qwen2_5_vision.py: RMSNorm, gated SiLU MLP, windowed attention). Its images'
M-RoPE positions are Qwen2-VL's (the seconds per frame Qwen2.5-VL adds matter for videos only, which are not
served)."""

from __future__ import annotations

from embedserv.models.families.qwen2_5_vision import Qwen25VisionTower
from embedserv.models.families.qwen2_vl import CHECKPOINT, Qwen2VLEmbedder
from embedserv.models.loading.family import Family, FamilyDocs


class Qwen25VLEmbedder(Qwen2VLEmbedder):
    tower_class = Qwen25VisionTower


FAMILY = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    model_class=Qwen25VLEmbedder,
    checkpoint=CHECKPOINT,
    is_encoder=False,
    pooling="lasttoken",
)

DOCS = FamilyDocs(
    # Any Qwen2.5-VL checkpoint loads; no single-vector embedder published on it was checked against its card.
    examples=(),
    tested_by=("tests/models/test_qwen_vl_embed_parity.py", "tests/models/test_qwen_vl_embed_engine.py"),
)
