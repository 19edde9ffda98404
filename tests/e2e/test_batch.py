"""`embedserv batch` end to end with the bundled MiniLM: vectors equal to the server's Embed for the same texts,
in input order, from JSONL, CSV and Parquet; bad rows to the errors file with exit status 1; a run killed at a
random point and rerun ends complete with no row twice; an OpenAI batch file answered as the server's routes
answer. The server here is the session's compat server (tests/helpers/compat_server.py)."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.corpus import stdlib_texts
from embedserv import logs
from embedserv.batch.outputs import MANIFEST, read_vectors
from embedserv.cli import main
from tests.helpers import server_fork
from tests.helpers.client import RPC_TIMEOUT_S
from tests.helpers.compat_http import http, pb, stub  # noqa: F401 - the fixtures
from tests.helpers.compat_server import EMBEDDER
from tests.helpers.models import bundled_model_dir
from tests.helpers.processes import wait_for
from tests.helpers.server import exit_code, log_tail

REPO = Path(__file__).resolve().parents[2]
TEXTS = stdlib_texts(90, seed=21)


def _batch(monkeypatch, *args: str) -> int:
    """`embedserv batch` through cli.main in this process (its log set-up left alone)."""
    monkeypatch.setattr(logs, "configure", lambda *a, **k: None)
    model = ["--model", str(bundled_model_dir()), "--no-warm-up", "--no-progress"]
    return main(["batch", *model, *args])


def _server_vectors(stub, texts: list[str]) -> np.ndarray:
    rows = []
    for start in range(0, len(texts), 32):  # the compat server's --max-client-batch-size
        request = pb().EmbedRequest(model=EMBEDDER, inputs=texts[start : start + 32], truncate=True)
        rows += [list(e.values) for e in stub.Embed(request, timeout=RPC_TIMEOUT_S).embeddings]
    return np.array(rows, dtype=np.float32)


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def expected(stub) -> np.ndarray:
    return _server_vectors(stub, TEXTS)


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_vectors_equal_the_servers_in_input_order(kind, tmp_path, monkeypatch, expected):
    records = [{"doc": f"d{i}", "body": text} for i, text in enumerate(TEXTS)]
    source = tmp_path / f"corpus.{kind}"
    if kind == "jsonl":
        _write_jsonl(source, records)
    elif kind == "csv":
        with open(source, "w", newline="") as file:
            writer = csv.DictWriter(file, ["doc", "body"])
            writer.writeheader()
            writer.writerows(records)
    else:
        pq.write_table(pa.Table.from_pylist(records), source, row_group_size=40)
    out = tmp_path / "out"
    code = _batch(
        monkeypatch, "--input", str(source), "--output", str(out), "--column", "body", "--id-column", "doc",
        "--truncate", "--shard-rows", "32", "--call-size", "8",
    )  # fmt: skip
    assert code == 0
    rows, ids, vectors = read_vectors(str(out))
    assert rows == list(range(len(TEXTS))) and ids == [f"d{i}" for i in range(len(TEXTS))]
    np.testing.assert_allclose(vectors, expected, rtol=0, atol=1e-5)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and manifest["next_row"] == len(TEXTS) and len(manifest["shards"]) == 3


def test_bad_rows_go_to_the_errors_file_and_the_rest_is_written(tmp_path, monkeypatch, stub):
    short = ["the first short text", "another short one"]
    long_text = "word " * 2000
    records = [{"text": short[0]}, {"text": ""}, {"other": 1}, {"text": long_text}, {"text": short[1]}]
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    with open(source, "a") as file:
        file.write("{not json\n")
    out = tmp_path / "out"
    assert _batch(monkeypatch, "--input", str(source), "--output", str(out)) == 1
    rows, _, vectors = read_vectors(str(out))
    assert rows == [0, 4]
    np.testing.assert_allclose(vectors, _server_vectors(stub, short), rtol=0, atol=1e-5)
    errors = [json.loads(line) for line in (out / "part-00000.errors.jsonl").read_text().splitlines()]
    assert [e["row"] for e in errors] == [1, 2, 3, 5]
    reasons = " | ".join(e["error"] for e in errors)
    for words in ("is empty", "'text' is missing", "truncate", "not JSON"):
        assert words in reasons
    # Rerunning a complete output does nothing and says the same.
    assert _batch(monkeypatch, "--input", str(source), "--output", str(out)) == 1
    # Another input into the same output is refused, unless --overwrite.
    other = _write_jsonl(tmp_path / "other.jsonl", [{"text": "x"}])
    assert _batch(monkeypatch, "--input", str(other), "--output", str(out)) == 2
    assert _batch(monkeypatch, "--input", str(other), "--output", str(out), "--overwrite") == 0
    assert read_vectors(str(out))[0] == [0]


def test_a_run_killed_anywhere_resumes_with_no_row_lost_or_twice(tmp_path, stub):
    texts = [f"sentence number {i} about {TEXTS[i % len(TEXTS)][:40]}" for i in range(480)]
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": str(i)} for i, t in enumerate(texts)])
    out = tmp_path / "out"
    command = [
        "batch", "--model", str(bundled_model_dir()), "--no-warm-up", "--input", str(source), "--output", str(out),
        "--id-column", "id", "--shard-rows", "40",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = server_fork.start(command, env, REPO, tmp_path / "killed.log")
    try:
        shards = random.Random().randint(1, 6)

        def written() -> int:
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before the kill: {log_tail(proc.log_path, 2000)}")
            manifest = out / MANIFEST
            return len(json.loads(manifest.read_text())["shards"]) if manifest.exists() else 0

        wait_for(lambda: written() >= shards, 120, interval=0.01, what=f"{shards} shards written")
        time.sleep(random.random() * 0.2)  # anywhere: mid-shard, mid-rename, mid-manifest
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    resumed = server_fork.start(command, env, REPO, tmp_path / "resumed.log")
    try:
        assert exit_code(resumed, 300) == 0
    finally:
        resumed.kill()  # nothing once it has exited
    rows, ids, vectors = read_vectors(str(out))
    assert rows == list(range(len(texts))) and ids == [str(i) for i in range(len(texts))]
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    # The server's vectors, for a sample of rows on both sides of the kill.
    sample = sorted(random.Random(5).sample(range(len(texts)), 16))
    np.testing.assert_allclose(vectors[sample], _server_vectors(stub, [texts[i] for i in sample]), rtol=0, atol=1e-5)


def test_an_openai_batch_file_is_answered_as_the_server_answers(tmp_path, monkeypatch, http):
    bodies = [
        {"model": EMBEDDER, "input": ["one short text", "and a second", "a third"]},
        {"model": EMBEDDER, "input": "a fourth, alone", "dimensions": 64, "encoding_format": "float"},
        {"model": EMBEDDER, "input": []},
        {"model": "no-such-model", "input": "x"},
    ]
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings", "body": b} for i, b in enumerate(bodies)]
    lines.append({"custom_id": "g", "method": "GET", "url": "/v1/models", "body": {}})
    source = _write_jsonl(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "out"
    assert _batch(monkeypatch, "--input", str(source), "--output", str(out), "--served-model-name", EMBEDDER) == 1
    answers = [json.loads(line) for line in (out / "part-00000.jsonl").read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["c0", "c1", "c2", "c3", "g"]
    for answer, body in zip(answers[:4], bodies, strict=True):
        server = http.post("/v1/embeddings", json=body)
        assert answer["response"]["status_code"] == server.status_code
        got, want = answer["response"]["body"], server.json()
        if server.status_code == 200:
            assert got["model"] == want["model"] and got["usage"] == want["usage"]
            np.testing.assert_allclose(
                [d["embedding"] for d in got["data"]], [d["embedding"] for d in want["data"]], rtol=0, atol=1e-5
            )
        else:
            assert got["error"]["type"] == want["error"]["type"]
    assert answers[4]["response"] is None and "only POST" in answers[4]["error"]["message"]
    errors = [json.loads(line) for line in (out / "part-00000.errors.jsonl").read_text().splitlines()]
    assert [(e["row"], e["id"]) for e in errors] == [(2, "c2"), (3, "c3"), (4, "g")]


def test_the_ray_data_stage_embeds_as_the_server_without_ray(stub):
    """The stage Ray calls (a dict of columns and a DataFrame in, the same with vectors added), called here as
    map_batches calls each actor: starting a local Ray alone costs about 30 s on 2 cores, so that run is slow."""
    import pandas as pd

    from embedserv.batch.ray_data import Embedder

    texts = [f"ray row {i}: {TEXTS[i][:60]}" for i in range(20)]
    stage = Embedder(str(bundled_model_dir()), warm_up=False)
    try:
        columns = stage({"text": np.array(texts[:12]), "id": np.arange(12)})
        frame = stage(pd.DataFrame({"text": texts[12:], "id": range(12, 20)}))
        empty = stage({"text": np.array([], dtype=object)})
    finally:
        stage.engine.close()
    assert list(columns["id"]) == list(range(12)) and list(frame["id"]) == list(range(12, 20))
    vectors = np.concatenate([columns["embedding"], np.stack(frame["embedding"].to_list())])
    np.testing.assert_allclose(vectors, _server_vectors(stub, texts), rtol=0, atol=1e-5)
    assert len(empty["embedding"]) == 0


@pytest.mark.slow
def test_the_ray_data_stage_embeds_as_the_server_on_a_local_ray(stub):
    """The documented Ray Data example (docs/batch.md) on a local Ray with 2 CPUs."""
    import ray

    from embedserv.batch.ray_data import Embedder

    texts = [f"ray row {i}: {TEXTS[i][:60]}" for i in range(48)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ds = ray.data.from_items([{"text": text, "id": i} for i, text in enumerate(texts)])
        model = {"model": str(bundled_model_dir()), "warm_up": False}
        ds = ds.map_batches(Embedder, fn_constructor_kwargs=model, concurrency=1, batch_size=16)
        rows = sorted(ds.take_all(), key=lambda row: row["id"])
    finally:
        ray.shutdown()
    assert [row["text"] for row in rows] == texts
    vectors = np.stack([np.asarray(row["embedding"]) for row in rows])
    np.testing.assert_allclose(vectors, _server_vectors(stub, texts), rtol=0, atol=1e-5)
