"""The `embedserv serve` command's flags (cli.py turns them into typed config).

Flags that set config fields have no argparse default: a flag not given leaves the value to the config file, then
to the dataclass default, which their help shows.
"""

from __future__ import annotations

import argparse

from embedserv import cpu_isa
from embedserv.batch.flags import add_batch_command
from embedserv.config import (
    ATTENTION_BACKENDS,
    ATTENTION_KINDS,
    CPU_ALLOCATORS,
    CPU_KV_CACHE_BYTES,
    CUDA_BATCH_TOKENS,
    CUDA_KV_CACHE_FRACTION,
    DTYPES,
    LOG_FORMATS,
    POOLING_MODES,
    QUANTIZATIONS,
    ModelConfig,
    ServerConfig,
    default_of,
)


def _model(name: str) -> str:
    return f"(default: {default_of(ModelConfig, name)})"


def _server(name: str) -> str:
    return f"(default: {default_of(ServerConfig, name)})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedserv", description="gRPC inference server for embedding, reranking, classification and generation"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    # serve's flags; `embedserv batch` takes the same model flags and --config file (batch_flags.py).
    serve = argparse.ArgumentParser(add_help=False)
    serve.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML file with server: settings, defaults: for every model and a models: list with "
        "each model's own options (docs/configuration.md)",
    )
    serve.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="PATH",
        help="local Hugging Face or sentence-transformers directory; repeatable "
        "(default: the --config file's models, else the bundled all-MiniLM-L6-v2); "
        "not with a --config file that lists models",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        metavar="NAME",
        help="name clients use, paired with --model in order (default: the directory name)",
    )
    serve.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=PATH",
        type=lora_flag,
        help="serve a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) "
        "as model NAME (or MODEL:NAME) over the --model; repeatable; read at start-up only "
        "(with several models: each model's lora: in the --config file) " + _model("lora"),
    )
    serve.add_argument("--host", help=_server("host"))
    serve.add_argument("--port", type=int, help=_server("port"))
    serve.add_argument("--device", help=f"cpu, cuda or cuda:N {_model('device')}")
    serve.add_argument("--dtype", choices=DTYPES, help=f"auto is float32 on CPU and bfloat16 on CUDA {_model('dtype')}")
    serve.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="int8: the model's linear layers in int8 on CPU (per-token activation and "
        "per-channel weight scales), the rest in --dtype (auto: bfloat16 where the CPU has it "
        "natively, else float32); embedders, rerankers and classifiers (default: none)",
    )
    serve.add_argument(
        "--cpu-allocator",
        choices=CPU_ALLOCATORS,
        help="CPU worker processes on tcmalloc (preloaded; auto: where libtcmalloc_minimal.so.4 is "
        f"installed) or glibc's malloc {_model('cpu_allocator')}",
    )
    serve.add_argument(
        "--cpu-fusion",
        choices=cpu_isa.FUSIONS,
        help="int8's per-token quantize and dequantize steps compiled by inductor into one C++ "
        "loop each (compiled; needs a C++ compiler), eager, or per CPU ISA (auto) "
        f"{_model('cpu_fusion')}",
    )
    serve.add_argument(
        "--max-batch-tokens",
        type=int,
        help="token budget of one forward pass (default: per CPU ISA, 4096 on AVX2/AVX-512; "
        f"{CUDA_BATCH_TOKENS} on CUDA)",
    )
    serve.add_argument(
        "--max-batch-requests", type=int, help=f"sequences in one forward pass at most {_model('max_batch_requests')}"
    )
    serve.add_argument(
        "--max-concurrent-requests",
        type=int,
        help="inputs in flight across all calls; past it calls get RESOURCE_EXHAUSTED "
        + _server("max_concurrent_requests"),
    )
    serve.add_argument(
        "--max-client-batch-size", type=int, help=f"inputs one call may carry {_server('max_client_batch_size')}"
    )
    serve.add_argument(
        "--max-input-chars",
        type=int,
        metavar="N",
        help="characters one input may have, checked before tokenizing (the gRPC message "
        f"limit follows from this and --max-client-batch-size) {_server('max_input_chars')}",
    )
    serve.add_argument(
        "--max-images-per-request",
        type=int,
        metavar="N",
        help="images one call may carry, for models that take images; 0 refuses images "
        + _server("max_images_per_request"),
    )
    serve.add_argument(
        "--max-image-bytes",
        type=int,
        metavar="N",
        help=f"encoded bytes one image may have (PNG, JPEG, WebP) {_model('max_image_bytes')}",
    )
    serve.add_argument(
        "--max-image-pixels",
        type=int,
        metavar="N",
        help="pixels (width x height) one image may decode to, read from its header before it "
        f"is decoded {_model('max_image_pixels')}",
    )
    serve.add_argument(
        "--attention-backend",
        metavar="NAME",
        help=f"force an attention backend ({', '.join(ATTENTION_BACKENDS)}); "
        "default: the fastest that runs on the device",
    )
    serve.add_argument(
        "--attention",
        choices=ATTENTION_KINDS,
        help="override the causality read from the model config (decoders causal unless "
        "is_causal: false; encoders bidirectional)",
    )
    serve.add_argument(
        "--pooling",
        choices=POOLING_MODES,
        help="override the pooling read from the model's sentence-transformers files",
    )
    serve.add_argument(
        "--decoder-reranker",
        action=argparse.BooleanOptionalAction,
        help="serve causal-LM checkpoints as yes/no rerankers (Qwen3-Reranker template); "
        "default: when the model's path names a reranker",
    )
    serve.add_argument(
        "--kv-cache-memory",
        metavar="SIZE",
        help="KV cache of generating models: bytes (2GiB, 512MiB, 1e9) or, on CUDA, a fraction "
        f"of the memory free after loading (default: {CPU_KV_CACHE_BYTES / 2**30:g}GiB on CPU, "
        f"{CUDA_KV_CACHE_FRACTION} on CUDA)",
    )
    serve.add_argument(
        "--kv-block-size",
        type=int,
        help="tokens per KV cache block (default: what the attention backend's paged kernel wants: "
        "256 for flash_attn, 16 for the others)",
    )
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="reuse the cached KV of full blocks that requests share at the start of their "
        f"prompts {_model('enable_prefix_caching')}",
    )
    serve.add_argument(
        "--kv-sharing-fast-prefill",
        action=argparse.BooleanOptionalAction,
        help="models whose last layers reuse an earlier layer's KV (Gemma 3n/4): run those layers "
        "only on the rows whose output is read (sampled tokens, last-token pooling) "
        + _model("kv_sharing_fast_prefill"),
    )
    serve.add_argument(
        "--embedding-cache",
        metavar="SIZE",
        help="keep the outputs of sequences already run (embed, rerank, classify) in an LRU of this "
        "many bytes per model (256MiB, 1GB); identical inputs with the same options are "
        "answered from it, bit-identical; a call may bypass it; 0 keeps none (default: 0)",
    )
    serve.add_argument(
        "--auto-truncate",
        action=argparse.BooleanOptionalAction,
        help="cut inputs longer than the model takes to fit instead of refusing them (OpenAI, TEI "
        f"and gRPC alike); a request's own truncate setting wins {_model('auto_truncate')}",
    )
    serve.add_argument(
        "--input-type-prompt",
        action="append",
        dest="input_types",
        metavar="TYPE=PROMPT",
        type=input_type_flag,
        help="Cohere /v2/embed's input_type TYPE (search_query, search_document, classification, clustering, "
        "image) embeds with the model's prompt PROMPT; repeatable; a type not given takes the model's prompt of "
        "its name, else query for search_query and document, passage or corpus for search_document "
        + _model("input_types"),
    )
    serve.add_argument(
        "--data-parallel-size",
        type=int,
        metavar="N",
        help="worker processes per model, each with its own replica (CPU: they share the cores) "
        + _model("data_parallel_size"),
    )
    serve.add_argument(
        "--replicas-per-device",
        type=int,
        metavar="N",
        help=f"with --device cuda: how many replicas may share one GPU {_model('replicas_per_device')}",
    )
    serve.add_argument(
        "--default-priority",
        type=int,
        metavar="N",
        help=f"priority of calls that name none (higher runs sooner) {_model('default_priority')}",
    )
    serve.add_argument(
        "--priority-batch-tokens",
        type=int,
        metavar="N",
        help="tokens of a batch holding lower-priority inputs while higher-priority calls come "
        "(default: an eighth of --max-batch-tokens)",
    )
    serve.add_argument(
        "--priority-aging",
        type=float,
        metavar="SECONDS",
        help=f"an input waiting this long runs before any priority {_model('priority_aging')}",
    )
    serve.add_argument(
        "--pipeline-depth",
        type=int,
        metavar="N",
        help="batches in flight per worker (1: no overlap of preparing and running) " + _model("pipeline_depth"),
    )
    serve.add_argument(
        "--worker-timeout",
        type=float,
        metavar="SECONDS",
        help=f"kill and restart a worker whose batch runs longer than this {_model('worker_timeout')}",
    )
    serve.add_argument(
        "--worker-memory-limit",
        metavar="SIZE|PERCENT%",
        help="replace a worker process between steps once its resident memory passes this: a size per worker "
        "(3GiB), or a share of the container's memory limit split among the model's workers (80%%) "
        + _model("worker_memory_limit"),
    )
    serve.add_argument(
        "--allow-pickle",
        action="store_true",
        default=None,
        help="load pytorch_model.bin (pickle) checkpoints when a model has no safetensors; "
        f"pickles can run code, so only for checkpoints you trust {_model('allow_pickle')}",
    )
    serve.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        help="run every step shape once in each worker before serving; --no-warm-up starts "
        f"sooner, and the first calls of each shape are slower (for tests) {_model('warm_up')}",
    )
    serve.add_argument(
        "--tokenizer-threads", type=int, help=f"tokenizer threads per model {_server('tokenizer_threads')}"
    )
    serve.add_argument(
        "--frontends",
        type=int,
        metavar="N",
        help="processes serving gRPC and HTTP on the same ports, each parsing and tokenizing its "
        "calls for one engine process; 0: one per 4 CPUs (at most 8) " + _server("frontends"),
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        metavar="SECONDS",
        help=f"on SIGTERM/SIGINT, how long in-flight calls may take to finish {_server('drain_timeout')}",
    )
    serve.add_argument(
        "--max-connection-age",
        type=float,
        metavar="SECONDS",
        help="close each client connection after about this long (calls in flight finish); "
        "round-robin clients then re-resolve DNS and find new replicas (default: never)",
    )
    serve.add_argument(
        "--http-port",
        type=int,
        metavar="PORT",
        help=f"serve the HTTP APIs (OpenAI, Cohere/Jina rerank, TEI) on this port; 0: off {_server('http_port')}",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)",
    )
    serve.add_argument(
        "--api-key",
        help="require metadata 'authorization: Bearer KEY' on every RPC but health "
        "(default: env EMBEDSERV_API_KEY, else the config file's; none: no auth)",
    )
    serve.add_argument(
        "--api-keys-file",
        dest="api_keys",
        metavar="YAML",
        help="named API keys, each a tenant: a YAML list of {name, key, priority, max_share} (a mounted Secret); "
        "the config file's server: api_keys takes the same list (default: none)",
    )
    serve.add_argument("--tls-cert", metavar="PEM", help="TLS certificate chain (with --tls-key)")
    serve.add_argument("--tls-key", metavar="PEM", help="TLS private key")
    serve.add_argument(
        "--tls-client-ca", metavar="PEM", help="mutual TLS: clients must present a certificate signed by this CA"
    )
    serve.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="send OpenTelemetry traces to this OTLP/gRPC collector (http://HOST:4317); the "
        "OTEL_* environment applies (default: off)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="info logs every prefill batch; debug every call and generation step (default: info)",
    )
    serve.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="json: one JSON object per line, the workers' and front ends' too (default: text)",
    )
    commands.add_parser(
        "serve", help="serve models over gRPC and HTTP", parents=[serve],
        description="Flags given here override the --config file's server: settings and its defaults: for "
                    "every model; a model's own keys in the file override the flags.",
    )  # fmt: skip
    add_batch_command(commands, serve)
    return parser


def lora_flag(text: str) -> tuple[str, str]:
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise argparse.ArgumentTypeError(
            f"--lora takes NAME=PATH (an adapter's served name and directory), not {text!r}"
        )
    return name, path


def input_type_flag(text: str) -> tuple[str, str]:
    input_type, equals, prompt = text.partition("=")
    if not equals or not input_type or not prompt:
        raise argparse.ArgumentTypeError(
            f"--input-type-prompt takes TYPE=PROMPT (a Cohere input_type and one of the model's prompts), not {text!r}"
        )
    return input_type, prompt
