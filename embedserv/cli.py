"""Command line: `embedserv serve ...`. Flags become typed config here and nowhere else."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from embedserv import logs
from embedserv.config import (
    ATTENTION_BACKENDS,
    ATTENTION_KINDS,
    DTYPES,
    LOG_FORMATS,
    POOLING_MODES,
    ModelConfig,
    ServerConfig,
    bundled_model_path,
    parse_memory,
)
from embedserv.errors import ConfigError

# The bundled model's directory is called `model`; serve it under its real name.
BUNDLED_MODEL_NAME = "all-MiniLM-L6-v2"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedserv", description="gRPC inference server for embedding, reranking, classification and generation"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve models over gRPC")
    serve.add_argument("--model", action="append", default=None, metavar="PATH",
                       help="local Hugging Face or sentence-transformers directory; repeatable "
                            "(default: the bundled all-MiniLM-L6-v2)")
    serve.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                       help="name clients use, paired with --model in order (default: the directory name)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    serve.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="auto is float32 on CPU and bfloat16 on CUDA")
    serve.add_argument("--max-batch-tokens", type=int, default=None,
                       help="token budget of one forward pass (default: 4096 on CPU, 16384 on CUDA)")
    serve.add_argument("--max-batch-requests", type=int, default=512,
                       help="sequences in one forward pass at most")
    serve.add_argument("--max-concurrent-requests", type=int, default=512,
                       help="inputs in flight across all calls; past it calls get RESOURCE_EXHAUSTED")
    serve.add_argument("--max-client-batch-size", type=int, default=256, help="inputs one call may carry")
    serve.add_argument("--max-input-chars", type=int, default=100_000, metavar="N",
                       help="characters one input may have, checked before tokenizing (the gRPC message "
                            "limit follows from this and --max-client-batch-size)")
    serve.add_argument("--attention-backend", default=None, metavar="NAME",
                       help=f"force an attention backend ({', '.join(ATTENTION_BACKENDS)}); "
                            "default: the fastest that runs on the device")
    serve.add_argument("--attention", default=None, choices=ATTENTION_KINDS,
                       help="override the causality read from the model config (decoders causal unless "
                            "is_causal: false; encoders bidirectional)")
    serve.add_argument("--pooling", default=None, choices=POOLING_MODES,
                       help="override the pooling read from the model's sentence-transformers files")
    serve.add_argument("--decoder-reranker", default=None, action=argparse.BooleanOptionalAction,
                       help="serve causal-LM checkpoints as yes/no rerankers (Qwen3-Reranker template); "
                            "default: when the model's path names a reranker")
    serve.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                       help="KV cache of generating models: bytes (2GiB, 512MiB, 1e9) or, on CUDA, a fraction "
                            "of the memory free after loading (default: 1GiB on CPU, 0.5 on CUDA)")
    serve.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV cache block")
    serve.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                       help="reuse the cached KV of full blocks that requests share at the start of their prompts")
    serve.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="worker processes per model, each with its own replica (CPU: they share the cores)")
    serve.add_argument("--replicas-per-device", type=int, default=1, metavar="N",
                       help="with --device cuda: how many replicas may share one GPU")
    serve.add_argument("--pipeline-depth", type=int, default=2, metavar="N",
                       help="batches in flight per worker (1: no overlap of preparing and running)")
    serve.add_argument("--worker-timeout", type=float, default=120.0, metavar="SECONDS",
                       help="kill and restart a worker whose batch runs longer than this")
    serve.add_argument("--allow-pickle", action="store_true",
                       help="load pytorch_model.bin (pickle) checkpoints when a model has no safetensors; "
                            "pickles can run code, so only for checkpoints you trust")
    serve.add_argument("--tokenizer-threads", type=int, default=1, help="tokenizer threads per model")
    serve.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, how long in-flight calls may take to finish")
    serve.add_argument("--max-connection-age", type=float, default=None, metavar="SECONDS",
                       help="close each client connection after about this long (calls in flight finish); "
                            "round-robin clients then re-resolve DNS and find new replicas (default: never)")
    serve.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    serve.add_argument("--api-key", default=None,
                       help="require metadata 'authorization: Bearer KEY' on every RPC but health "
                            "(default: env EMBEDSERV_API_KEY; neither: no auth)")
    serve.add_argument("--tls-cert", default=None, metavar="PEM", help="TLS certificate chain (with --tls-key)")
    serve.add_argument("--tls-key", default=None, metavar="PEM", help="TLS private key")
    serve.add_argument("--tls-client-ca", default=None, metavar="PEM",
                       help="mutual TLS: clients must present a certificate signed by this CA")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    serve.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                       help="json: one JSON object per line")
    return parser


def served_names(paths: list[str], names: list[str] | None) -> list[str]:
    if names and len(names) != len(paths):
        raise ConfigError(
            f"{len(names)} --served-model-name for {len(paths)} --model; give one name per model or none"
        )
    if names:
        return names
    bundled = bundled_model_path().resolve()
    return [BUNDLED_MODEL_NAME if Path(p).resolve() == bundled else Path(p).resolve().name for p in paths]


def server_config(args: argparse.Namespace) -> ServerConfig:
    paths = args.model or [str(bundled_model_path())]
    models = tuple(
        ModelConfig(
            path=path,
            served_name=name,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            attention=args.attention,
            pooling=args.pooling,
            decoder_reranker=args.decoder_reranker,
            max_batch_tokens=args.max_batch_tokens,
            max_batch_requests=args.max_batch_requests,
            kv_cache_memory=parse_memory(args.kv_cache_memory) if args.kv_cache_memory else None,
            kv_block_size=args.kv_block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            data_parallel_size=args.data_parallel_size,
            replicas_per_device=args.replicas_per_device,
            pipeline_depth=args.pipeline_depth,
            worker_timeout=args.worker_timeout,
            allow_pickle=args.allow_pickle,
        )
        for path, name in zip(paths, served_names(paths, args.served_model_name))
    )
    return ServerConfig(
        models=models,
        host=args.host,
        port=args.port,
        max_concurrent_requests=args.max_concurrent_requests,
        max_client_batch_size=args.max_client_batch_size,
        max_input_chars=args.max_input_chars,
        tokenizer_threads=args.tokenizer_threads,
        drain_timeout=args.drain_timeout,
        metrics_port=args.metrics_port,
        max_connection_age=args.max_connection_age,
        # The environment keeps the key out of `ps`; the flag wins when both are given.
        api_key=args.api_key if args.api_key is not None else os.environ.get("EMBEDSERV_API_KEY") or None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    # Models are local directories; never reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from embedserv.server.app import run

    try:
        asyncio.run(run(server_config(args)))
    except ConfigError as exc:
        logging.getLogger("embedserv").error("%s", exc)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
