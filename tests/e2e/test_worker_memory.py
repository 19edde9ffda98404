"""--worker-memory-limit: a worker process past it is replaced between steps, not killed: calls under load all end
OK with the server's vectors (they wait for the successor), a generation stream on it runs to its end first, and
the replacement shows in the log and on /metrics. A ceiling below any process's size replaces each worker about
a second after it is ready, so a short load sees several replacements."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from embedserv import memory_ceiling
from embedserv.errors import ConfigError
from tests.helpers.client import RPC_TIMEOUT_S, embed_request, inference_stub, response_matrix
from tests.helpers.metrics import scrape
from tests.helpers.processes import wait_for, worker_pids
from tests.helpers.server import free_port, running_server

TEXTS = [f"text number {i} about memory ceilings" for i in range(8)]


def test_sizes_and_shares_of_the_container_limit(tmp_path, monkeypatch):
    memory_ceiling.check("3GiB")
    memory_ceiling.check("80%")
    for bad in ("0", "0%", "120%", "lots", "x%"):
        with pytest.raises(ConfigError, match="--worker-memory-limit"):
            memory_ceiling.check(bad)
    assert memory_ceiling.ceiling_bytes("", 2) == 0
    assert memory_ceiling.ceiling_bytes("1GiB", 2) == 2**30  # a size is each worker's
    assert memory_ceiling.ceiling_bytes("50%", 2, limit=8 * 2**30) == 2 * 2**30  # a share, split among the workers
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("max\n")
    assert memory_ceiling.container_limit((v2, v1)) is None
    v1.write_text(f"{4 * 2**30}\n")
    assert memory_ceiling.container_limit((tmp_path / "absent", v1)) == 4 * 2**30
    monkeypatch.setattr(memory_ceiling, "_CGROUP_LIMITS", (v2,))
    with pytest.raises(ConfigError, match="this container has none; give a size"):
        memory_ceiling.ceiling_bytes("80%", 1)
    monkeypatch.setattr(memory_ceiling, "_CGROUP_LIMITS", (v1,))
    assert memory_ceiling.ceiling_bytes("80%", 4) == int(4 * 2**30 * 0.8 / 4)
    assert memory_ceiling.rss_bytes(1 << 30) is None


def _worker_rss(server_pid: int) -> int:
    return max(memory_ceiling.rss_bytes(pid) or 0 for pid in worker_pids(server_pid))


def _long_texts(n: int) -> list[str]:
    return [f"{i} " + "a longer text that fills the model's window with many tokens " * 30 for i in range(n)]


# With a generation stream on a second model: the same, and more worker starts (in the slow run).
STREAM = pytest.mark.parametrize("with_stream", [False, pytest.param(True, marks=pytest.mark.slow)])


@STREAM
def test_a_worker_past_the_ceiling_is_replaced_between_steps_and_no_call_is_lost(
    bundled_dir, tiny_generator, with_stream
):
    models = ["--model", str(bundled_dir), "--served-model-name", "minilm"]
    if with_stream:
        models += ["--model", str(tiny_generator("llama")), "--served-model-name", "llama"]
    # The workers' size once loaded and warm from small calls: the ceiling goes a little above it, and calls
    # of long texts (bigger activations) pass it.
    with running_server(models) as (target, proc), grpc.insecure_channel(target) as channel:
        inference_stub(channel).Embed(embed_request(TEXTS, model="minilm"), timeout=RPC_TIMEOUT_S)
        loaded = _worker_rss(proc.pid)
    metrics_port = free_port()
    ceiling = f"{(loaded + 24 * 2**20) // 2**20}MiB"
    args = [*models, "--worker-memory-limit", ceiling, "--metrics-port", str(metrics_port)]
    with running_server(args) as (target, proc), grpc.insecure_channel(target) as channel:
        stub = inference_stub(channel)
        reference = response_matrix(stub.Embed(embed_request(TEXTS, model="minilm"), timeout=RPC_TIMEOUT_S))
        first_workers = set(worker_pids(proc.pid))
        # A stream running when its worker is to be replaced ends first (whole), then the worker goes.
        from embedserv.v1 import embedserv_pb2 as pb

        generate = pb.GenerateRequest(model="llama", prompt="one two three", max_tokens=24, ignore_eos=True)
        streamed: list = []
        stream = threading.Thread(
            target=lambda: streamed.extend(stub.Generate(generate, timeout=RPC_TIMEOUT_S)), daemon=True
        )
        if with_stream:
            stream.start()
        outcomes = []
        for _ in range(2):  # long texts grow the worker past its ceiling; the short ones check the answers
            for texts in (_long_texts(32), TEXTS):
                try:
                    got = response_matrix(
                        stub.Embed(embed_request(texts, model="minilm", truncate=True), timeout=RPC_TIMEOUT_S)
                    )
                    outcomes.append(
                        len(got) == len(texts)
                        and (texts is not TEXTS or bool(np.allclose(got, reference, rtol=0, atol=1e-5)))
                    )
                except grpc.RpcError as err:
                    outcomes.append(f"{err.code().name}: {err.details()}")
        assert outcomes and all(outcome is True for outcome in outcomes), outcomes
        if with_stream:
            stream.join(RPC_TIMEOUT_S)
            assert sum(len(reply.token_ids) for reply in streamed) == 24 and streamed[-1].finish_reason
        minilm_first = wait_for(
            lambda: scrape(metrics_port).value("embedserv_worker_memory_restarts_total", model="minilm"), 60,
            what="a minilm worker replaced",
        )  # fmt: skip
        assert minilm_first >= 1 and first_workers - set(worker_pids(proc.pid))
        assert scrape(metrics_port).total("embedserv_worker_resident_bytes") > 2**20
    log = proc.log_path.read_text()
    assert "past --worker-memory-limit" in log and "replacing it once its steps in flight end" in log
    assert "died" not in log  # replaced, not lost
