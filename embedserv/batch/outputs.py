"""What `embedserv batch` writes: numbered shards in input order, each with its errors file, and a manifest.

A shard and its errors file are written under temporary names, then renamed, then the manifest (also written
and renamed) records them; the manifest is the truth. A run killed anywhere leaves at worst a temporary file or a
shard the manifest does not list, both removed when the same command runs again, which goes on from the
manifest's next row: no row is written twice or lost. A manifest from another input or other settings is refused
unless --overwrite starts over.

Shards: `part-NNNNN.parquet` (columns `row`, `id` when the input has an id column, `embedding` as a fixed-size
list of the encoding's type) or `part-NNNNN.jsonl` (OpenAI batch output lines). Errors:
`part-NNNNN.errors.jsonl`, one `{"row", "id", "error"}` per row that did not run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from embedserv.errors import ConfigError

MANIFEST = "manifest.json"


@dataclass
class Manifest:
    # What the output is of: the input file (path, size, mtime) and the settings that shape the rows.
    fingerprint: dict
    shards: list[dict] = field(default_factory=list)
    next_row: int = 0
    failed_rows: int = 0
    complete: bool = False


class ShardWriter:
    def __init__(self, directory: str, fingerprint: dict, kind: str, overwrite: bool) -> None:
        """`kind`: parquet or jsonl (OpenAI batch output)."""
        self.directory = Path(directory)
        self.kind = kind
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manifest = self._start(fingerprint, overwrite)

    def _start(self, fingerprint: dict, overwrite: bool) -> Manifest:
        path = self.directory / MANIFEST
        manifest = None
        if path.exists() and not overwrite:
            saved = json.loads(path.read_text())
            if saved.get("fingerprint") != fingerprint:
                raise ConfigError(
                    f"--output {self.directory} holds a run of another input or other settings; give --overwrite "
                    "to start over, or another --output"
                )
            manifest = Manifest(**saved)
        listed = {name for shard in (manifest.shards if manifest else []) for name in (shard["file"], shard["errors"])}
        for stale in self.directory.glob("part-*"):  # a crash's leftovers, or the run --overwrite replaces
            if stale.name not in listed:
                stale.unlink()
        if manifest is None:
            manifest = Manifest(fingerprint)
            self._save(manifest)
        return manifest

    def write(self, first_row: int, rows: int, table, errors: list[dict]) -> None:
        """Shard number len(shards): rows [first_row, first_row + rows) as `table` (a pyarrow Table for
        Parquet, a list of JSON lines for jsonl) and their `errors`, then the manifest."""
        number = len(self.manifest.shards)
        name = f"part-{number:05d}.{self.kind}"
        errors_name = f"part-{number:05d}.errors.jsonl"
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            _atomic(self.directory / name, lambda path: pq.write_table(table, path))
        else:
            _atomic(self.directory / name, lambda path: _write_lines(path, table))
        _atomic(self.directory / errors_name, lambda path: _write_lines(path, [json.dumps(e) for e in errors]))
        manifest = self.manifest
        manifest.shards.append({"file": name, "errors": errors_name, "first_row": first_row, "rows": rows})
        manifest.next_row = first_row + rows
        manifest.failed_rows += len(errors)
        self._save(manifest)

    def finish(self) -> None:
        self.manifest.complete = True
        self._save(self.manifest)

    def _save(self, manifest: Manifest) -> None:
        text = json.dumps(asdict(manifest), indent=1) + "\n"
        _atomic(self.directory / MANIFEST, lambda path: Path(path).write_text(text))


def _write_lines(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for line in lines:
            file.write(line + "\n")


def _atomic(path: Path, write) -> None:
    """`write(temporary path)`, flushed to disk, then renamed over `path` (a reader sees all of it or none)."""
    temporary = path.with_name(path.name + ".tmp")
    write(str(temporary))
    with open(temporary, "rb") as file:
        os.fsync(file.fileno())
    os.replace(temporary, path)


def vectors_table(rows: list[int], ids: list[str] | None, vectors: np.ndarray):
    """The Parquet shard: `row`, `id` (if the input has ids), `embedding` (fixed-size list)."""
    import pyarrow as pa

    dimension = vectors.shape[1] if vectors.ndim == 2 else 0
    flat = pa.array(np.ascontiguousarray(vectors).reshape(-1))
    columns = {"row": pa.array(rows, pa.int64())}
    if ids is not None:
        columns["id"] = pa.array(ids, pa.string())
    columns["embedding"] = pa.FixedSizeListArray.from_arrays(flat, dimension)
    return pa.table(columns)


def read_vectors(directory: str) -> tuple[list[int], list[str | None], np.ndarray]:
    """Every written row in order, with its id and vector (for tests and quick checks)."""
    import pyarrow.parquet as pq

    manifest = json.loads((Path(directory) / MANIFEST).read_text())
    rows, ids, vectors = [], [], []
    for shard in manifest["shards"]:
        table = pq.read_table(Path(directory) / shard["file"])
        rows += table.column("row").to_pylist()
        ids += table.column("id").to_pylist() if "id" in table.column_names else [None] * table.num_rows
        embedding = table.column("embedding").combine_chunks()
        if table.num_rows:
            vectors.append(np.asarray(embedding.flatten()).reshape(table.num_rows, -1))
    return rows, ids, np.concatenate(vectors) if vectors else np.zeros((0, 0), np.float32)
