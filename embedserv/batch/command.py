"""`embedserv batch`: one model in this process (in --data-parallel-size worker processes when above 1) over a
corpus file, written as resumable shards (outputs.py). Exit status: 0 all rows written, 1 some rows failed (the
errors files say why), 2 the run cannot start, 3 the run stopped on an error (a worker that died, a full disk),
130 interrupted; after 3 or 130, the same command goes on from the last shard written."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from embedserv.batch.inputs import count_rows, input_format, read_rows
from embedserv.batch.outputs import ShardWriter
from embedserv.batch.progress import Progress
from embedserv.batch.runner import TextEmbedder, run_shards, shards_of
from embedserv.config import ModelConfig, ServerConfig
from embedserv.engine.core.local_core import LocalCore
from embedserv.engine.engine import Engine
from embedserv.errors import ConfigError
from embedserv.types import EmbedParams, Encoding, TruncationDirection

logger = logging.getLogger("embedserv.batch")


def run(args: argparse.Namespace, config: ServerConfig) -> int:
    try:
        return asyncio.run(_run(args, config))
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    except KeyboardInterrupt:
        logger.warning("interrupted: run the same command again to go on from the last shard written")
        return 130
    except Exception:
        logger.exception("the run stopped; run the same command again to go on from the last shard written")
        return 3


def _params(args: argparse.Namespace) -> EmbedParams:
    return EmbedParams(
        normalize=args.normalize,
        truncate=args.truncate,
        truncation_direction=TruncationDirection(args.truncation_direction),
        dimensions=args.dimensions,
        prompt_name=args.prompt_name,
        encoding=Encoding(args.encoding),
    )


def _check(args: argparse.Namespace, config: ServerConfig) -> tuple[ModelConfig, str]:
    if len(config.models) != 1:
        raise ConfigError(f"embedserv batch runs one model; the flags and --config file give {len(config.models)}")
    for flag, value in (
        ("--shard-rows", args.shard_rows),
        ("--call-size", args.call_size),
        ("--concurrency", args.concurrency),
    ):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, not {value}")
    if not Path(args.input).is_file():
        raise ConfigError(f"--input {args.input} is not a file")
    kind = input_format(args.input, args.input_format)
    if kind != "openai":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ConfigError("the Parquet output needs pyarrow: pip install 'embedserv[batch]'") from None
    return config.models[0], kind


def _fingerprint(args: argparse.Namespace, model: ModelConfig, kind: str) -> dict:
    """What makes two runs' rows the same: the input file as it is, the model and what shapes each row."""
    stat = os.stat(args.input)
    return {
        "input": os.path.abspath(args.input), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": kind,
        "model": os.path.abspath(model.path), "dtype": model.dtype, "quantization": model.quantization,
        "columns": [args.column, args.id_column, args.image_column], "shard_rows": args.shard_rows,
        "params": [args.normalize, args.truncate, args.truncation_direction, args.dimensions, args.prompt_name,
                   args.encoding],
    }  # fmt: skip


async def _run(args: argparse.Namespace, config: ServerConfig) -> int:
    model, kind = _check(args, config)
    writer = ShardWriter(
        args.output, _fingerprint(args, model, kind), "jsonl" if kind == "openai" else "parquet", args.overwrite
    )
    manifest = writer.manifest
    if manifest.complete:
        logger.info("%s is complete (%d rows failed); --overwrite runs it again", args.output, manifest.failed_rows)
        return 1 if manifest.failed_rows else 0
    if model.data_parallel_size > 1:
        core = await asyncio.to_thread(LocalCore.with_worker_processes, model, config.tokenizer_threads)
    else:
        core = await asyncio.to_thread(LocalCore.load, model, config.tokenizer_threads, model.warm_up)
    await core.start()
    try:
        engine = Engine(model, core.served, core)
        rows = read_rows(args.input, kind, args.column, args.id_column, args.image_column, manifest.next_row)
        progress = Progress(count_rows(args.input, kind), manifest.next_row, args.progress, args.log_every)
        if kind == "openai":
            from embedserv.batch.openai_batch import OpenAIBatch  # FastAPI loads only for OpenAI batch files

            answerer = OpenAIBatch(engine, config, args.concurrency)
            try:
                await run_shards((answerer.start(s) for s in shards_of(rows, args.shard_rows)), writer, progress)
            finally:
                await answerer.aclose()
        else:
            embedder = TextEmbedder(engine, _params(args), args.call_size, args.concurrency, args.id_column is not None)
            await run_shards((embedder.start(s) for s in shards_of(rows, args.shard_rows)), writer, progress)
        progress.close()
    finally:
        await core.stop()
    if manifest.failed_rows:
        logger.warning("%d rows failed; the errors files in %s say why", manifest.failed_rows, args.output)
    return 1 if manifest.failed_rows else 0
