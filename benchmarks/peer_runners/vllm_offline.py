"""vLLM in process: LLM(runner="pooling").embed() (peer vllm-offline). Runs under the vLLM venv:

    .peers/vllm/bin/python -m benchmarks.peer_runners.vllm_offline JOB.json

Every pass hands vLLM all texts in one embed() call: vLLM batches them itself under its token budget, which
is how its docs say to get its best throughput. Inputs are truncated to the model's max_seq_length
(max_model_len, truncate_prompt_tokens=-1). The CPU thread binding comes from the environment the driver sets
(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU, VLLM_CPU_KVCACHE_SPACE).
"""

from __future__ import annotations

import time

from .common import read_job, read_texts, warm_then_best_of, write_result

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def main() -> None:
    from vllm import LLM

    job = read_job()
    texts = read_texts(job)
    start = time.perf_counter()
    llm = LLM(model=job["model"], runner="pooling", dtype=DTYPES[job["precision"]],
              max_model_len=job["max_seq_length"], seed=0)  # fmt: skip
    load_seconds = time.perf_counter() - start

    def embed(batch: list[str]) -> list[list[float]]:
        outputs = llm.embed(batch, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": -1})
        return [output.outputs.embedding for output in outputs]

    seconds, vectors = warm_then_best_of(job, embed, texts)
    write_result(
        job,
        vectors,
        seconds=seconds,
        load_seconds=load_seconds,
        setup=f"LLM.embed(all texts), dtype {DTYPES[job['precision']]}, max_model_len {job['max_seq_length']}",
    )


if __name__ == "__main__":
    main()
