"""Reading a corpus for `embedserv batch`: JSONL, CSV, Parquet, or an OpenAI batch file, one Row at a time.

Rows stream: a reader holds one line (JSONL, CSV) or one Parquet record batch, never the file, so memory stays
bounded whatever the corpus size. A row that cannot be read (bad JSON, no text column, an image path that does
not open) becomes a Row with its error, which the run writes to the errors file and goes on.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from embedserv.errors import ConfigError
from embedserv.types import ImageInput

FORMATS = ("jsonl", "csv", "parquet", "openai")
_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
_PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class Row:
    # Its place in the input, from 0: the output keeps this order, and a resumed run starts at a row number.
    index: int
    # The id column's value as text; None without an id column (the output's `row` then identifies it).
    id: str | None = None
    # A text, or an image (--image-column: a file path read here) for models that take images.
    item: str | ImageInput | None = None
    # An OpenAI batch line (custom_id, method, url, body).
    request: dict | None = None
    # Why the row cannot run (it goes to the errors file).
    error: str | None = None


def input_format(path: str, given: str | None) -> str:
    """--input-format, else the file's: .csv, .parquet, or a JSONL file whose first line is an OpenAI request."""
    if given:
        return given
    suffix = Path(path).suffix.lower()
    kind = _EXTENSIONS.get(suffix)
    if kind is None:
        raise ConfigError(f"--input {path}: cannot tell its format from {suffix!r}; give --input-format {FORMATS}")
    if kind == "jsonl" and _first_line_is_openai(path):
        return "openai"
    return kind


def _first_line_is_openai(path: str) -> bool:
    with open(path, encoding="utf-8") as file:
        for line in file:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(first, dict) and "custom_id" in first and "body" in first
    return False


def count_rows(path: str, kind: str) -> int | None:
    """The input's rows (for the progress bar's ETA): Parquet's metadata, else its lines; None if unknown."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as file:
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: file.read(1 << 20), b""))
    return max(0, lines - 1) if kind == "csv" else lines


def read_rows(path: str, kind: str, column: str, id_column: str | None, image_column: str | None, start: int = 0):
    """Every row from `start` on (a resumed run skips what it wrote)."""
    if kind == "parquet":
        records = _parquet_records(path, start)
        first = start
    else:
        records = _jsonl_records(path) if kind in ("jsonl", "openai") else _csv_records(path)
        first = 0
    for index, record in enumerate(records, first):
        if index < start:
            continue
        if kind == "openai":
            yield _openai_row(index, record)
        else:
            yield _row(index, record, column, id_column, image_column)


def _row(index: int, record: dict | str, column: str, id_column: str | None, image_column: str | None) -> Row:
    if isinstance(record, str):  # a line that did not parse
        return Row(index, error=record)
    row_id = None if id_column is None or record.get(id_column) is None else str(record[id_column])
    if image_column is not None:
        return _image_row(index, row_id, record.get(image_column), image_column)
    text = record.get(column)
    if not isinstance(text, str):
        what = "missing" if text is None else f"a {type(text).__name__}, not text"
        return Row(index, row_id, error=f"column {column!r} is {what}")
    if not text.strip():
        return Row(index, row_id, error=f"column {column!r} is empty")
    return Row(index, row_id, item=text)


def _image_row(index: int, row_id: str | None, value: object, column: str) -> Row:
    if isinstance(value, (bytes, bytearray)):
        return Row(index, row_id, item=ImageInput(bytes(value)))
    if not isinstance(value, str) or not value:
        return Row(index, row_id, error=f"column {column!r} must hold an image file path or the image's bytes")
    try:
        return Row(index, row_id, item=ImageInput(Path(value).read_bytes()))
    except OSError as exc:
        return Row(index, row_id, error=f"cannot read image {value}: {exc.strerror}")


def _openai_row(index: int, record: dict | str) -> Row:
    if isinstance(record, str):
        return Row(index, error=record)
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not isinstance(record.get("body"), dict) or not record.get("url"):
        return Row(index, error="an OpenAI batch line needs custom_id (text), url and body (an object)")
    return Row(index, custom_id, request=record)


def _jsonl_records(path: str) -> Iterator[dict | str]:
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                yield f"line {number} is empty"
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"line {number} is not JSON: {exc.msg}"
                continue
            yield record if isinstance(record, dict) else f"line {number} is not a JSON object"


def _csv_records(path: str) -> Iterator[dict | str]:
    with open(path, encoding="utf-8", newline="") as file:
        yield from csv.DictReader(file)


def _parquet_records(path: str, start: int) -> Iterator[dict | str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet needs pyarrow: pip install 'embedserv[batch]'") from None
    file = pq.ParquetFile(path)
    skipped = 0
    for group in range(file.num_row_groups):
        rows = file.metadata.row_group(group).num_rows
        if skipped + rows <= start:  # a resumed run does not read the groups it wrote
            skipped += rows
            continue
        for batch in file.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group]):
            if skipped + batch.num_rows <= start:
                skipped += batch.num_rows
                continue
            records = batch.to_pylist()[max(0, start - skipped) :]
            skipped = max(skipped, start)
            yield from records
