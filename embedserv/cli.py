"""Command line: `embedserv serve ...`. Flags become typed config here and nowhere else."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from embedserv import logs
from embedserv.api_keys import read_api_keys_file
from embedserv.cli_parser import build_parser
from embedserv.config import ServerConfig
from embedserv.config_file import MODEL_OPTION_KEYS, SERVER_KEYS, assemble, read_config_file
from embedserv.errors import ConfigError
from embedserv.executor import zygote
from embedserv.sizes import parse_bytes, parse_memory

__all__ = ["build_parser", "main", "server_config"]


def given_flags(args: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, object]:
    """The config fields among `keys` whose flags were given (argparse leaves the others None)."""
    return {key: getattr(args, key) for key in keys if getattr(args, key) is not None}


def server_config(args: argparse.Namespace) -> ServerConfig:
    model_flags = given_flags(args, MODEL_OPTION_KEYS)
    if "kv_cache_memory" in model_flags:
        model_flags["kv_cache_memory"] = parse_memory(model_flags["kv_cache_memory"])
    if "embedding_cache" in model_flags:
        model_flags["embedding_cache"] = parse_bytes(model_flags["embedding_cache"], "--embedding-cache")
    server_flags = given_flags(args, SERVER_KEYS)
    if "api_keys" in server_flags:
        server_flags["api_keys"] = read_api_keys_file(str(server_flags["api_keys"]))
    # The environment keeps the key out of `ps`; the flag wins over it, and it over the config file.
    if "api_key" not in server_flags and os.environ.get("EMBEDSERV_API_KEY"):
        server_flags["api_key"] = os.environ["EMBEDSERV_API_KEY"]
    if "lora" in model_flags:
        if args.model and len(args.model) > 1:
            raise ConfigError(
                "--lora serves adapters over one --model; with several models give each its lora: in the --config file"
            )
        model_flags["lora"] = tuple(model_flags["lora"])
    if "input_types" in model_flags:
        model_flags["input_types"] = tuple(model_flags["input_types"])
    config_file = read_config_file(args.config) if args.config else None
    return assemble(config_file, model_flags, server_flags, args.model, args.served_model_name)


def main(argv: list[str] | None = None) -> int:
    """`embedserv ...`. Without `argv` (the console script, `python -m embedserv`) this process is the server's own;
    called with `argv` by a program, it leaves that program's process as it is (its environment, no forks)."""
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    # Models are local directories; never reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    own_process = argv is None and args.command == "serve"
    if own_process:
        # The server's own libraries load as its CPU workers' do, so that their zygote can be forked from it.
        os.environ.update(zygote.cpu_thread_environment(os.environ))
        zygote.record_load_environment()
    try:
        config = server_config(args)
        if args.command == "batch":
            from embedserv.batch.command import run as run_batch

            return run_batch(args, config)
        from embedserv.server.app import fork_worker_zygote, run

        if own_process:
            fork_worker_zygote(config)
        asyncio.run(run(config))
    except ConfigError as exc:
        logging.getLogger("embedserv").error("%s", exc)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
