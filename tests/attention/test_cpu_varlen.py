"""The cpu_varlen C++ kernel against the naive oracle on random packed batches, and its build and fallback.

Its shared cases (cross, suffix, paged, windows) run in the other files of tests/attention with every backend;
here the kernel's own axes: head sizes 32 to 128 (80 too, not a power of two), GQA, causal and windowed, both
dtypes, suffix queries, strided views of one fused projection, int64 offsets, any thread count. The kernel is
built once per machine (cached on disk, cpu_varlen_kernel.py) and loaded once per process.
"""

import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embedserv.attention.backends import cpu_varlen_kernel
from embedserv.attention.backends.cpu_varlen import CpuVarlenBackend
from embedserv.attention.backends.naive import NaiveBackend
from embedserv.attention.layer import Attention
from embedserv.attention.metadata import build_common_metadata, build_suffix_metadata, cumulative_offsets
from embedserv.attention.selector import AttentionSpec, unsupported_reason
from embedserv.forward_context import set_forward_context
from embedserv.worker.layer_routes import forward_context_for
from tests.attention.test_backends import LENGTH_MIXES, TOLERANCE
from tests.helpers.matrix import matrix

pytestmark = pytest.mark.skipif(
    unsupported_reason("cpu_varlen", AttentionSpec(torch.device("cpu"), torch.float32, 64, 4, 4, False)) is not None,
    reason="cpu_varlen cannot run here (no C++ compiler)",
)

HEADS = [(4, 4), (8, 2), (12, 12)]
HEAD_IDS = ["mha", "gqa", "minilm"]
WINDOWS = [None, 1, 7, 100]
# (len_q, len_k) per sequence: the prefill skip's queries, the last len_q of their sequence's positions.
SUFFIX_PAIRS = [(5, 70), (16, 16), (1, 3), (1, 1), (2, 9), (66, 70), (130, 600), (1, 300)]


def _tensors(num_q, num_k, heads, kv_heads, head_size, dtype, seed=0, fused=False):
    gen = torch.Generator().manual_seed(seed)
    if fused:
        # q, k and v as the model passes them: column slices of one projection's output.
        qkv = torch.randn(num_q, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
        return qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=1)
    q = torch.randn(num_q, heads * head_size, generator=gen).to(dtype)
    k = torch.randn(num_k, kv_heads * head_size, generator=gen).to(dtype)
    v = torch.randn(num_k, kv_heads * head_size, generator=gen).to(dtype)
    return q, k, v


def _attend(backend, common, tensors, heads, kv_heads, head_size, window=None):
    layer = Attention(heads, head_size, num_kv_heads=kv_heads, sliding_window=window)
    context = forward_context_for([layer], backend, backend.build_metadata(common))
    with set_forward_context(context):
        return layer(*tensors).float()


def _check(common, tensors, heads, kv_heads, head_size, dtype, window=None, backend=None):
    backend = backend or CpuVarlenBackend()
    actual = _attend(backend, common, tensors, heads, kv_heads, head_size, window)
    expected = _attend(NaiveBackend(), common, tensors, heads, kv_heads, head_size, window)
    torch.testing.assert_close(actual, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# The whole matrix runs with --run-slow; the default run, its pairwise cover (tests/helpers/matrix.py).
@matrix(
    "lens,causal,window,heads,kv_heads,head_size,dtype",
    [LENGTH_MIXES, [False, True], WINDOWS, HEADS, [32, 64, 80, 128], [torch.float32, torch.bfloat16]],
    ids=[lambda lens: f"{len(lens)}seqs", lambda c: "causal" if c else "bidirectional", None,
         lambda h: HEAD_IDS[HEADS.index(h)]],
    spread=(3,),
)  # fmt: skip
def test_whole_sequences_match_naive(lens, causal, window, heads, kv_heads, head_size, dtype):
    common = build_common_metadata(np.array(lens), is_causal=causal)
    tensors = _tensors(sum(lens), sum(lens), heads, kv_heads, head_size, dtype)
    _check(common, tensors, heads, kv_heads, head_size, dtype, window)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_suffix_queries_match_naive(causal, window, dtype):
    lens_q, lens_k = np.array([p[0] for p in SUFFIX_PAIRS]), np.array([p[1] for p in SUFFIX_PAIRS])
    cu_q, cu_k = (torch.from_numpy(cumulative_offsets(x)) for x in (lens_q, lens_k))
    common = build_suffix_metadata(lens_q, lens_k, cu_q, cu_k, is_causal=causal)
    tensors = _tensors(int(lens_q.sum()), int(lens_k.sum()), 8, 2, 64, dtype)
    _check(common, tensors, 8, 2, 64, dtype, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(12, 12), (8, 2)], ids=["mha", "gqa"])
def test_strided_views_of_a_fused_projection(dtype, heads, kv_heads):
    lens = [130, 64, 17, 1]
    common = build_common_metadata(np.array(lens), is_causal=True)
    tensors = _tensors(sum(lens), sum(lens), heads, kv_heads, 32, dtype, fused=True)
    assert not tensors[0].is_contiguous()
    _check(common, tensors, heads, kv_heads, 32, dtype)


def test_int64_offsets_and_thread_counts_give_the_same_bits():
    op = cpu_varlen_kernel.attention_op()
    lens = np.array([200, 90, 33, 1, 1, 64])
    q, k, v = (t.view(-1, 12, 32) for t in _tensors(int(lens.sum()), int(lens.sum()), 12, 12, 32, torch.float32))
    cu = torch.from_numpy(cumulative_offsets(lens))
    first = op(q, k, v, cu.int(), cu.int(), True, 0, 32**-0.5)
    torch.testing.assert_close(op(q, k, v, cu, cu, True, 0, 32**-0.5), first, atol=0, rtol=0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = op(q, k, v, cu, cu, True, 0, 32**-0.5)
    finally:
        torch.set_num_threads(threads)
    # A sequence's result depends on its own rows only, never on which thread ran it.
    torch.testing.assert_close(alone, first, atol=0, rtol=0)


def test_the_library_runs_its_tasks_on_torchs_threads():
    """ATen's parallel_for, inlined into the kernel, opens an OpenMP parallel region only when the kernel is built
    with OpenMP: without it every call ran on one thread, however many torch had (2 threads took as long as 1)."""
    cpu_varlen_kernel.attention_op()  # built and cached
    library = cpu_varlen_kernel.library_path(cpu_varlen_kernel.compiler())
    assert b"GOMP_parallel" in library.read_bytes()


def test_no_sequences():
    backend = CpuVarlenBackend()
    common = build_common_metadata(np.array([], dtype=np.int64), is_causal=False)
    out = _attend(backend, common, _tensors(0, 0, 4, 4, 32, torch.float32), 4, 4, 32)
    assert out.shape == (0, 128)


def test_without_the_kernel_it_runs_sdpa_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_varlen_kernel, "_loaded", {})
    monkeypatch.setattr(cpu_varlen_kernel, "compiler", lambda: None)
    with caplog.at_level(logging.WARNING):
        backend = CpuVarlenBackend()
    assert not backend.uses_kernel
    assert "compiled kernel unavailable (no C++ compiler on PATH); running sdpa" in caplog.text
    common = build_common_metadata(np.array([40, 7, 1]), is_causal=True)
    _check(common, _tensors(48, 48, 8, 2, 64, torch.float32), 8, 2, 64, torch.float32, backend=backend)


def test_a_failed_build_is_logged_and_not_cached(monkeypatch, caplog, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_varlen_kernel, "_loaded", {})
    monkeypatch.setattr(cpu_varlen_kernel, "SOURCE", broken)
    monkeypatch.setenv("EMBEDSERV_KERNEL_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert cpu_varlen_kernel.attention_op() is None
    assert "compiled kernel unavailable (RuntimeError" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


def test_a_failing_source_stops_the_other_compile_at_once(monkeypatch, tmp_path):
    """The sources compile at once; the first failure ends the build with its error and stops the others (a
    compile still running would hold the build, and the lock every other process waits on, to its end)."""
    monkeypatch.setattr(cpu_varlen_kernel, "_BUILD_TIMEOUT", 30)
    pid_file = tmp_path / "pid"
    still_compiling = ["sh", "-c", f"echo $$ > {pid_file}.part && mv {pid_file}.part {pid_file} && exec sleep 600"]
    wait_then_fail = f"until [ -f {pid_file} ]; do sleep 0.01; done; echo 'broken.cpp: error: expected' >&2; exit 1"
    failing = ["sh", "-c", wait_then_fail]
    with pytest.raises(RuntimeError, match="broken.cpp: error: expected"):
        cpu_varlen_kernel._run([still_compiling, failing], "c++", tmp_path)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_cache_is_keyed_by_the_source(monkeypatch, tmp_path):
    cxx = cpu_varlen_kernel.compiler()
    before = cpu_varlen_kernel.library_path(cxx)
    edited = tmp_path / "cpu_varlen.cpp"
    edited.write_text(cpu_varlen_kernel.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_varlen_kernel, "SOURCE", edited)
    assert cpu_varlen_kernel.library_path(cxx) != before


def test_processes_that_start_at_once_build_the_kernel_once(monkeypatch, tmp_path):
    """Data-parallel workers (or test workers) that start together: one builds under the file lock, the others wait
    for it and load its library (two loaders here, each with its own open lock file, as two processes have)."""
    import threading
    import time

    builds, loads = [], []

    def build(cxx, path):
        builds.append(path)
        time.sleep(0.3)
        path.write_bytes(b"built")

    monkeypatch.setenv("EMBEDSERV_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_varlen_kernel, "compiler", lambda: "c++")
    monkeypatch.setattr(cpu_varlen_kernel, "_build", build)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loads.append(path))
    monkeypatch.setattr(torch.ops, "embedserv_cpu_varlen", SimpleNamespace(attention="op"), raising=False)
    loaders = [threading.Thread(target=cpu_varlen_kernel._load) for _ in range(2)]
    for loader in loaders:
        loader.start()
    for loader in loaders:
        loader.join()
    assert len(builds) == 1 and len(loads) == 2


def test_the_cache_is_keyed_by_every_file_of_the_library(monkeypatch, tmp_path):
    """The paged decode source and the header both sources include count as the source does."""
    cxx = cpu_varlen_kernel.compiler()
    before = cpu_varlen_kernel.library_path(cxx)
    for name in ("_PAGED_DECODE", "_HEADER"):
        original = getattr(cpu_varlen_kernel, name)
        edited = tmp_path / original.name
        edited.write_text(original.read_text() + "\n// edited\n")
        monkeypatch.setattr(cpu_varlen_kernel, name, edited)
        assert cpu_varlen_kernel.library_path(cxx) != before, name
        monkeypatch.setattr(cpu_varlen_kernel, name, original)
