"""embedserv batch's pieces without a model: rows read lazily from each format (and from a resume point), at most
two shards held whatever the corpus size, shards and manifest written so that a crash leaves nothing half-done."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedserv.batch.inputs import count_rows, input_format, read_rows
from embedserv.batch.outputs import MANIFEST, ShardWriter, read_vectors, vectors_table
from embedserv.batch.progress import Progress
from embedserv.batch.runner import ShardDone, run_shards, shards_of
from embedserv.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"t{i}", "id": i}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("start", [0, 7, 40, 100])
def test_every_format_reads_the_same_rows_from_any_start(tmp_path, start):
    records = [{"text": f"t{i}", "id": i} for i in range(100)]
    _jsonl(tmp_path / "a.jsonl", 100)
    (tmp_path / "a.csv").write_text("text,id\n" + "".join(f"t{i},{i}\n" for i in range(100)))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet", row_group_size=30)
    for name in ("a.jsonl", "a.csv", "a.parquet"):
        path = str(tmp_path / name)
        kind = input_format(path, None)
        assert count_rows(path, kind) == 100
        rows = list(read_rows(path, kind, "text", "id", None, start))
        assert [(r.index, r.id, r.item) for r in rows] == [(i, str(i), f"t{i}") for i in range(start, 100)], name


def test_openai_files_are_told_by_their_first_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}) + "\n")
    assert input_format(str(path), None) == "openai"
    with pytest.raises(ConfigError, match="--input-format"):
        input_format(str(tmp_path / "x.txt"), None)


def test_at_most_two_shards_are_held_however_long_the_input(tmp_path):
    pulled = written = 0
    most_held = 0

    def rows():
        nonlocal pulled, most_held
        for row in read_rows(str(_jsonl(tmp_path / "in.jsonl", 1000)), "jsonl", "text", None, None):
            pulled += 1
            most_held = max(most_held, pulled - written)
            yield row

    class Writer:
        def write(self, first_row, rows, table, errors):
            nonlocal written
            written += rows

        def finish(self):
            pass

    async def shard(rows):
        await asyncio.sleep(0)
        return ShardDone(rows[0].index, len(rows), None, [], 0)

    async def run():
        shards = (asyncio.ensure_future(shard(s)) for s in shards_of(rows(), 50))
        await run_shards(shards, Writer(), Progress(None, 0, bar=False))

    asyncio.run(run())
    assert written == 1000 and most_held <= 2 * 50 + 1


def test_shards_and_manifest_resume_and_refuse_another_run(tmp_path):
    out = tmp_path / "out"
    writer = ShardWriter(str(out), {"input": "a"}, "parquet", overwrite=False)
    writer.write(0, 2, vectors_table([0, 1], None, np.eye(2, dtype=np.float32)), [])
    # A crash's leftovers: a temporary file and a shard the manifest does not list.
    (out / "part-00001.parquet.tmp").write_bytes(b"half")
    (out / "part-00001.parquet").write_bytes(b"unlisted")
    again = ShardWriter(str(out), {"input": "a"}, "parquet", overwrite=False)
    assert again.manifest.next_row == 2 and sorted(p.name for p in out.iterdir()) == [
        MANIFEST, "part-00000.errors.jsonl", "part-00000.parquet",
    ]  # fmt: skip
    again.write(2, 1, vectors_table([2], None, np.ones((1, 2), np.float32)), [{"row": 3, "id": None, "error": "x"}])
    again.finish()
    rows, _, vectors = read_vectors(str(out))
    assert rows == [0, 1, 2] and vectors.shape == (3, 2)
    assert json.loads((out / MANIFEST).read_text())["failed_rows"] == 1
    with pytest.raises(ConfigError, match="--overwrite"):
        ShardWriter(str(out), {"input": "b"}, "parquet", overwrite=False)
    fresh = ShardWriter(str(out), {"input": "b"}, "parquet", overwrite=True)
    assert fresh.manifest.next_row == 0 and not list(out.glob("part-*"))


@pytest.mark.slow
def test_memory_stays_flat_from_20k_to_200k_rows(tmp_path, tiny_encoder):
    """Peak RSS of `embedserv batch` on 200,000 rows stays within 100 MiB of its peak on 20,000 (tiny model)."""
    model = tiny_encoder("bert", "mean")
    peaks = []
    for n in (20_000, 200_000):
        source = _jsonl(tmp_path / f"in{n}.jsonl", n)
        command = [
            sys.executable, "-c", "import resource, sys; from embedserv.cli import main; code = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)",
            "batch", "--model", str(model), "--no-warm-up", "--no-progress", "--input", str(source),
            "--output", str(tmp_path / f"out{n}"), "--call-size", "256",
        ]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200, check=True)
        peaks.append(int(done.stdout.split()[-1]) // 1024)
        assert read_vectors(str(tmp_path / f"out{n}"))[0][-1] == n - 1
    assert peaks[1] - peaks[0] < 100, f"peak RSS {peaks} MiB"


def test_image_rows_take_a_path_or_bytes_and_a_bad_one_is_the_rows_error(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(b"\x89PNG fake")
    records = [{"img": str(image)}, {"img": b"raw bytes"}, {"img": str(tmp_path / "missing.png")}, {"img": 3}]
    # A Parquet column is one type: paths (strings) in one file, the images' bytes in another.
    for number, record in enumerate(records[:2]):
        pq.write_table(pa.Table.from_pylist([record]), tmp_path / f"ok{number}.parquet")
    rows = [next(read_rows(str(tmp_path / f"ok{n}.parquet"), "parquet", "text", None, "img")) for n in (0, 1)]
    assert [r.item.data for r in rows] == [b"\x89PNG fake", b"raw bytes"]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(records[2]) + "\n" + json.dumps(records[3]) + "\n")
    bad = list(read_rows(str(path), "jsonl", "text", None, "img"))
    assert "cannot read image" in bad[0].error and "file path or the image's bytes" in bad[1].error
