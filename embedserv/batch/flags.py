"""`embedserv batch`'s command line: serve's model flags and --config file, and what to read and write."""

from __future__ import annotations

import argparse

from embedserv.batch.inputs import FORMATS
from embedserv.types import Encoding, TruncationDirection


def add_batch_command(commands, serve_flags: argparse.ArgumentParser) -> None:
    batch = commands.add_parser(
        "batch",
        parents=[serve_flags],
        help="embed a corpus file into Parquet (or answer an OpenAI batch file), with progress and resume",
        description="Runs the first model of the flags or --config file in this process (no server; the serving "
        "flags are ignored) over --input, writing shards and a manifest to --output. Rerunning the same command "
        "after a crash or Ctrl-C goes on where it stopped. Exit status 1 when any row failed (see the errors "
        "files), 2 when the run cannot start, 3 when it stopped on an error, 130 when interrupted.",
    )
    batch.add_argument("--input", required=True, metavar="FILE", help="JSONL, CSV, Parquet or an OpenAI batch file")
    batch.add_argument("--output", required=True, metavar="DIR", help="shards, errors files and manifest.json")
    batch.add_argument("--input-format", choices=FORMATS, help="default: from the file's extension and first line")
    batch.add_argument("--column", default="text", help="the text column (default: text)")
    batch.add_argument("--id-column", help="a column copied to the output's id (default: none; rows are numbered)")
    batch.add_argument("--image-column", help="embed images instead: a column of file paths or bytes")
    batch.add_argument("--overwrite", action="store_true", help="start over instead of resuming")
    batch.add_argument("--truncate", action="store_true", help="cut texts past the model's limit (else: errors)")
    batch.add_argument(
        "--truncation-direction",
        default="right",
        choices=[d.value for d in TruncationDirection],
        help="(default: right)",
    )
    batch.add_argument("--prompt-name", help="the model's sentence-transformers prompt to embed with")
    batch.add_argument("--dimensions", type=int, help="keep the first N dimensions (Matryoshka)")
    batch.add_argument("--no-normalize", dest="normalize", action="store_false", help="raw pooled vectors")
    batch.add_argument(
        "--encoding", default="float32", choices=[e.value for e in Encoding], help="the vectors' (default: float32)"
    )
    batch.add_argument("--shard-rows", type=int, default=10_000, help="rows per output shard (default: 10000)")
    batch.add_argument("--call-size", type=int, default=64, help="rows per engine call (default: 64)")
    batch.add_argument("--concurrency", type=int, default=8, help="engine calls in flight (default: 8)")
    batch.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar (default: on a terminal; else a log line every --log-every seconds)",
    )
    batch.add_argument("--log-every", type=float, default=10.0, metavar="SECONDS", help="(default: 10)")
