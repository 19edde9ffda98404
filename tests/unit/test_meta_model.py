"""Models constructed on the meta device skip their initializers (embedserv/models/loading/meta.py): reading a
model's layout no longer imports torch._dynamo (1.4 s in every server, front-end and worker process), building
it not torch's symbolic shapes, and
nothing outside the context, in this thread or another, is changed."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch
from torch import nn

from embedserv.models.loading.meta import meta_model

READ_SPEC = """
import sys
from embedserv.config import ModelConfig, bundled_model_path
from embedserv.models.loading.spec_reader import read_model_spec
spec = read_model_spec(ModelConfig(path=str(bundled_model_path()), served_name="m"))
dynamo = "torch._dynamo" in sys.modules
from embedserv.models.loading.weights import build_model
build_model(spec.family, spec.hf_config, spec.files, spec.device, spec.dtype)
print(dynamo, "torch.fx.experimental.symbolic_shapes" in sys.modules)
"""


def test_reading_a_models_layout_does_not_import_dynamo_nor_building_it_symbolic_shapes():
    """Nor does building the model import torch's symbolic shapes (0.6 s of each worker's start: to_empty's
    empty_like on meta tensors did; models/loading/weights.py allocates with torch.empty instead)."""
    out = subprocess.run([sys.executable, "-c", READ_SPEC], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False False", out.stderr[-2000:]


def test_initializers_run_as_before_outside_the_context_and_in_other_threads():
    torch.manual_seed(0)
    before = nn.Linear(64, 64)
    built: dict[str, nn.Linear] = {}
    with meta_model():
        inside = nn.Linear(64, 64)
        thread = threading.Thread(target=lambda: built.setdefault("other", nn.Linear(64, 64)))
        thread.start()
        thread.join()
    torch.manual_seed(0)
    after = nn.Linear(64, 64)
    assert inside.weight.is_meta
    assert not built["other"].weight.is_meta and built["other"].weight.std() > 0.01
    torch.testing.assert_close(after.weight, before.weight)  # the same initializer, the same draw
    assert after.weight.std() > 0.01
