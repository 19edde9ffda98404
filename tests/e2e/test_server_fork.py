"""The test servers forked by tests/helpers/server_fork.py end as started ones do: the same exit code and log for
a start-up mistake, 0 after SIGTERM, -9 after SIGKILL, each read as a Popen's returncode."""

from __future__ import annotations

import signal

import pytest

from tests.helpers.server import exit_code, launched_server, running_server


# Started, the check is the same and costs an interpreter's start and imports: it runs with --run-slow.
@pytest.mark.parametrize("forked", ["1", pytest.param("0", marks=pytest.mark.slow)], ids=["forked", "started"])
def test_a_start_up_mistake_exits_2_with_its_message(forked, monkeypatch, tmp_path):
    monkeypatch.setenv("EMBEDSERV_TEST_FORK_SERVERS", forked)
    with launched_server(["--model", str(tmp_path / "missing")]) as (_, proc):
        assert exit_code(proc, 60) == 2
        log = proc.log_path.read_text()
    assert type(proc).__name__ == ("ForkedServer" if forked == "1" else "Popen")
    assert "missing" in log.splitlines()[-1] and "Traceback" not in log, log[-2000:]


def test_a_forked_server_exits_0_on_sigterm_and_minus_9_on_sigkill(bundled_dir, monkeypatch):
    monkeypatch.setenv("EMBEDSERV_TEST_FORK_SERVERS", "1")
    with running_server(["--model", str(bundled_dir)]) as (_, proc):
        assert type(proc).__name__ == "ForkedServer" and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert exit_code(proc, 60) == 0
        assert "stopped" in proc.log_path.read_text()
    with launched_server(["--model", str(bundled_dir)]) as (_, proc):
        proc.kill()
        assert exit_code(proc, 60) == -signal.SIGKILL
