"""sentence-transformers in process, on its torch, ONNX Runtime or OpenVINO backend (peers st-torch, st-onnx,
st-openvino). Runs under the sentence-transformers venv:

    .peers/st/bin/python -m benchmarks.peer_runners.st JOB.json

Precisions: torch fp32 and bf16 (the weights loaded in that dtype); ONNX fp32 and int8 (ONNX Runtime dynamic
quantization with the config that matches this CPU, via sentence-transformers'
export_dynamic_quantized_onnx_model); OpenVINO fp32 (f32 inference precision forced, so a CPU with native
bf16 does not switch to it) and int8 (static post-training quantization, NNCF through optimum-intel's
OVQuantizer, calibrated on the job's calibration texts: sentence-transformers'
export_static_quantized_openvino_model does the same but only with a dataset it downloads).
ONNX and OpenVINO models are exported from the model directory into the job's work directory.
encode() runs with batch size job["batch_size"] (sentence-transformers' default, 32).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from .common import cpu_info, ort_int8_config, read_job, read_texts, warm_then_best_of, write_result

BACKENDS = {"st-torch": "torch", "st-onnx": "onnx", "st-openvino": "openvino"}


def load_torch(job: dict):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(job["threads"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[job["precision"]]
    model = SentenceTransformer(job["model"], device="cpu", backend="torch", model_kwargs={"torch_dtype": dtype})
    return model, f"torch_dtype {dtype}"


def load_onnx(job: dict):
    import onnxruntime
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    def kwargs(**extra) -> dict:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = job["threads"]
        return {"provider": "CPUExecutionProvider", "session_options": options, **extra}

    model = SentenceTransformer(job["model"], device="cpu", backend="onnx", model_kwargs=kwargs())
    if job["precision"] == "fp32":
        return model, "ONNX Runtime CPUExecutionProvider"
    config = ort_int8_config(cpu_info()[1])
    if config is None:
        raise RuntimeError("no ONNX Runtime int8 config for this CPU (it needs AVX2)")
    saved = Path(job["work_dir"]) / "st-onnx"
    model.save(str(saved))
    export_dynamic_quantized_onnx_model(model, config, str(saved))
    # Saved as onnx/model_{weights dtype}_{config}.onnx: optimum's avx2 config quantizes weights to uint8 (u8u8).
    file_name = next(saved.glob(f"onnx/model_*_{config}.onnx")).relative_to(saved).as_posix()
    model = SentenceTransformer(str(saved), device="cpu", backend="onnx", model_kwargs=kwargs(file_name=file_name))
    return model, f"int8 = ONNX Runtime dynamic quantization, sentence-transformers' '{config}' config ({file_name})"


def load_openvino(job: dict):
    from sentence_transformers import SentenceTransformer

    ov_config = {"INFERENCE_NUM_THREADS": job["threads"], "INFERENCE_PRECISION_HINT": "f32"}
    model = SentenceTransformer(job["model"], device="cpu", backend="openvino", model_kwargs={"ov_config": ov_config})
    if job["precision"] == "fp32":
        return model, "OpenVINO CPU, f32 inference precision"
    saved = Path(job["work_dir"]) / "st-openvino"
    model.save(str(saved))
    file_name = quantize_openvino_static(model, read_texts(job, "calibration"), job["max_seq_length"], saved)
    model = SentenceTransformer(str(saved), device="cpu", backend="openvino",
                                model_kwargs={"ov_config": ov_config, "file_name": file_name})  # fmt: skip
    return model, (
        f"int8 = OpenVINO static quantization (NNCF via optimum-intel OVQuantizer: int8 weights and "
        f"activations), calibrated on {len(read_texts(job, 'calibration'))} corpus texts of another seed"
    )


def quantize_openvino_static(model, texts: list[str], max_length: int, saved: Path) -> str:
    """Quantizes the OpenVINO model of `model` (saved under `saved`) and adds it there; returns its file name."""
    import nncf
    from optimum.intel import OVConfig, OVQuantizationConfig, OVQuantizer

    ov_model = model.transformers_model
    names = set(ov_model.input_names)
    samples = []
    for text in texts:
        encoded = model.tokenizer(text, truncation=True, max_length=max_length, return_tensors="np")
        samples.append({key: value for key, value in encoded.items() if key in names})
    quantized = saved / "quantized"
    OVQuantizer.from_pretrained(ov_model).quantize(
        calibration_dataset=nncf.Dataset(samples),
        save_directory=str(quantized),
        ov_config=OVConfig(quantization_config=OVQuantizationConfig(num_samples=len(samples))),
    )
    # sentence-transformers wraps the OpenVINO model's save to write into an openvino/ subfolder.
    source = next(quantized.rglob("openvino_model.xml"))
    target = saved / "openvino" / "openvino_model_qint8_static.xml"
    shutil.move(source, target)
    shutil.move(source.with_suffix(".bin"), target.with_suffix(".bin"))
    shutil.rmtree(quantized)
    return "openvino/openvino_model_qint8_static.xml"


LOADERS = {"torch": load_torch, "onnx": load_onnx, "openvino": load_openvino}


def main() -> None:
    job = read_job()
    texts = read_texts(job)
    start = time.perf_counter()
    model, setup = LOADERS[BACKENDS[job["peer"]]](job)
    model.max_seq_length = job["max_seq_length"]
    load_seconds = time.perf_counter() - start

    def encode(batch: list[str]):
        return model.encode(batch, batch_size=job["batch_size"], convert_to_numpy=True)

    seconds, vectors = warm_then_best_of(job, encode, texts)
    write_result(
        job,
        vectors,
        seconds=seconds,
        load_seconds=load_seconds,
        setup=f"{setup}; encode(batch_size={job['batch_size']})",
    )


if __name__ == "__main__":
    main()
