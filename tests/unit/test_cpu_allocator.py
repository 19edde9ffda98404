"""--cpu-allocator: CPU workers start with tcmalloc preloaded where it is installed (auto), always
(tcmalloc, refused at start-up where missing) or never (glibc); CUDA workers are left alone."""

from __future__ import annotations

import pytest

from embedserv.config import ModelConfig
from embedserv.errors import ConfigError
from embedserv.worker import allocator

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def test_auto_preloads_tcmalloc_for_cpu_workers_where_found(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: TCMALLOC)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator.worker_environment("auto", "cpu") == {"LD_PRELOAD": TCMALLOC}
    assert allocator.worker_environment("tcmalloc", "cpu") == {"LD_PRELOAD": TCMALLOC}
    assert allocator.worker_environment("glibc", "cpu") == {}
    assert allocator.worker_environment("auto", "cuda:0") == {}


def test_a_preload_already_set_is_kept(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: TCMALLOC)
    monkeypatch.setenv("LD_PRELOAD", "/opt/libiomp5.so")
    assert allocator.worker_environment("auto", "cpu") == {"LD_PRELOAD": f"/opt/libiomp5.so {TCMALLOC}"}


def test_without_tcmalloc_auto_keeps_glibc_and_tcmalloc_is_refused(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert allocator.worker_environment("auto", "cpu") == {}
    with pytest.raises(ConfigError, match="apt install libtcmalloc-minimal4"):
        allocator.worker_environment("tcmalloc", "cpu")


def test_without_tcmalloc_the_server_says_once_how_to_get_it(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.setattr(allocator, "_told", False)
    with caplog.at_level("INFO", logger="embedserv.worker.allocator"):
        for _ in range(3):  # three workers, or one restarted
            assert allocator.worker_environment("auto", "cpu") == {}
        allocator.worker_environment("glibc", "cpu")
    told = [r.getMessage() for r in caplog.records if "libtcmalloc-minimal4" in r.getMessage()]
    assert len(told) == 1 and "1.02-1.12x" in told[0]


def test_the_worker_names_its_allocator(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", TCMALLOC)
    assert allocator.in_use() == "tcmalloc"
    monkeypatch.delenv("LD_PRELOAD")
    assert allocator.in_use() == "glibc"


def test_the_option_is_checked_and_reaches_the_config():
    from embedserv.cli import build_parser, server_config

    with pytest.raises(ConfigError, match="auto, tcmalloc, glibc"):
        ModelConfig(path="/m", served_name="m", cpu_allocator="jemalloc")
    config = server_config(build_parser().parse_args(["serve", "--model", "/m", "--cpu-allocator", "glibc"]))
    assert config.models[0].cpu_allocator == "glibc"
