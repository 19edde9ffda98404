"""zygote.fork_here forks only where a zygote forked from this process would be one started under the workers'
environment; the cases it refuses are decided before any fork (the server's own case: tests/e2e)."""

from __future__ import annotations

import os

from embedserv.executor import zygote


def test_what_libraries_read_as_they_load_is_compared_and_the_rest_is_not():
    env = {"LD_PRELOAD": "/lib/tcmalloc.so", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "3", "HOME": "/root"}
    # OMP_NUM_THREADS is each worker's own (it sets its threads itself); HOME is read when used.
    assert zygote._read_at_load(env) == {"LD_PRELOAD": "/lib/tcmalloc.so", "OMP_WAIT_POLICY": "PASSIVE"}


def test_without_a_record_the_environment_this_process_started_with_counts(monkeypatch):
    monkeypatch.setattr(zygote, "_load_environment", None)
    with open("/proc/self/environ", "rb") as environ:
        started = dict(os.fsdecode(e).partition("=")[::2] for e in environ.read().split(b"\0") if e)
    assert zygote._loaded_under() == zygote._read_at_load(started)


def test_a_different_load_time_setting_or_another_thread_refuses_before_forking(monkeypatch):
    forks = []

    class Forked:
        def alive(self) -> bool:
            return True

    forked = Forked()
    monkeypatch.setattr(zygote.Zygote, "forked_from_here", classmethod(lambda cls: forks.append(1) or forked))
    monkeypatch.setattr(zygote, "_zygotes", {})
    monkeypatch.setattr(zygote, "_prctl", lambda option, value: True)
    monkeypatch.setattr(zygote, "_load_environment", {"OMP_WAIT_POLICY": "PASSIVE"})
    monkeypatch.setattr(zygote.threading, "active_count", lambda: 1)
    workers = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "HOME": "/root"}
    assert not zygote.fork_here({**workers, "MALLOC_ARENA_MAX": "2"})
    assert not zygote.fork_here({"HOME": "/root"})  # loaded under a setting the workers do not have
    monkeypatch.setattr(zygote.threading, "active_count", lambda: 2)
    assert not zygote.fork_here(workers)
    monkeypatch.setattr(zygote.threading, "active_count", lambda: 1)
    monkeypatch.setenv("EMBEDSERV_WORKER_ZYGOTE", "0")
    assert not zygote.fork_here(workers)
    assert forks == []
    monkeypatch.delenv("EMBEDSERV_WORKER_ZYGOTE")
    assert zygote.fork_here(workers) and forks == [1]
    # It is the zygote for_environment then gives for that environment, whatever each worker's thread count.
    assert zygote.for_environment({**workers, "OMP_NUM_THREADS": "2"}) is forked
    assert not zygote.fork_here(workers) and forks == [1]  # one is enough


def test_only_the_servers_own_process_forks_its_zygote(bundled_dir, monkeypatch):
    """cli.main with argv (a program calling it, as tests do) must not fork that program's process; without (the
    console script, `python -m embedserv`) the process is the server's."""
    from embedserv import cli, logs
    from embedserv.server import app

    asked: list[dict] = []
    monkeypatch.setattr(zygote, "fork_here", lambda env: asked.append(env) or False)
    monkeypatch.setattr(logs, "configure", lambda *args, **kwargs: None)

    async def no_serving(config) -> None:
        return None

    monkeypatch.setattr(app, "run", no_serving)
    argv = ["serve", "--model", str(bundled_dir), "--http-port", "0"]
    assert cli.main(argv) == 0 and asked == []
    monkeypatch.setattr("sys.argv", ["embedserv", *argv])
    assert cli.main() == 0 and len(asked) == 1 and asked[0]["OMP_WAIT_POLICY"] == "PASSIVE"
