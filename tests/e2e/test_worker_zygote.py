"""Where the server forks its workers' zygote from (executor/zygote.py). A server whose own libraries loaded under
the settings its workers need forks it from itself, before it starts a thread: the zygote imports nothing. A setting
read as libraries load (the allocator's, OpenMP's) that the workers' environment has and the server's process did
not load under makes the server start the zygote plain, under the workers' environment.

The forked case is the default: test_frontends checks it, with front ends and two models."""

from __future__ import annotations

import grpc

from tests.helpers.client import RPC_TIMEOUT_S, embed_request, inference_stub, response_matrix
from tests.helpers.processes import cmdline, command_name, worker_pids, zygote_pids
from tests.helpers.server import running_server


def test_a_load_time_setting_the_server_did_not_load_under_gets_a_zygote_started_plain(bundled_dir, monkeypatch):
    # A forked test server's libraries loaded in its parent (tests/helpers/server_fork.py), without the setting: it
    # stands for a server whose workers' environment differs from what it loaded under.
    monkeypatch.setenv("EMBEDSERV_TEST_FORK_SERVERS", "1")
    env = {"MALLOC_ARENA_MAX": "2"}
    with running_server(["--model", str(bundled_dir)], env=env) as (target, proc):
        with grpc.insecure_channel(target) as channel:
            vectors = response_matrix(inference_stub(channel).Embed(embed_request(["a text"]), timeout=RPC_TIMEOUT_S))
        assert vectors.shape == (1, 384)
        (zygote,) = zygote_pids(proc.pid)
        assert cmdline(zygote)[1:3] == ["-m", "embedserv.executor.worker_main"] and "--zygote" in cmdline(zygote)
        with open(f"/proc/{zygote}/environ", "rb") as environ:
            assert b"MALLOC_ARENA_MAX=2" in environ.read().split(b"\0")
        (worker,) = worker_pids(proc.pid)
        assert command_name(worker) == "worker" and cmdline(worker) == cmdline(zygote)
