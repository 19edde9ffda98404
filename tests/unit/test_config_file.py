"""`embedserv serve --config FILE`: per-model options from YAML, how the file and the flags combine, and the
messages that say what to change in a bad file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from embedserv.cli import build_parser, server_config
from embedserv.config import ModelConfig, ServerConfig
from embedserv.errors import ConfigError

TWO_MODELS = """
server:
  port: 50052
  max_concurrent_requests: 1024
  metrics_port: 9100
defaults:
  dtype: float32
  max_batch_requests: 64
models:
  - path: /models/bge-small
    served_name: bge-small
    device: cpu
    max_batch_tokens: 4096
    pooling: cls
  - path: /models/qwen
    device: cuda:0
    dtype: bfloat16
    attention_backend: flash_attn
    max_batch_tokens: 32768
    kv_cache_memory: 0.5
    enable_prefix_caching: false
    worker_timeout: 300
"""


@pytest.fixture(autouse=True)
def _no_api_key_in_env(monkeypatch):
    monkeypatch.delenv("EMBEDSERV_API_KEY", raising=False)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "embedserv.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def load(tmp_path: Path, text: str, *flags: str) -> ServerConfig:
    argv = ["serve", "--config", write(tmp_path, text), *flags]
    return server_config(build_parser().parse_args(argv))


def test_two_models_with_their_own_device_dtype_backend_and_budget(tmp_path):
    config = load(tmp_path, TWO_MODELS)
    assert config == ServerConfig(
        models=(
            ModelConfig(path="/models/bge-small", served_name="bge-small", device="cpu", dtype="float32",
                        max_batch_tokens=4096, max_batch_requests=64, pooling="cls"),
            ModelConfig(path="/models/qwen", served_name="qwen", device="cuda:0", dtype="bfloat16",
                        attention_backend="flash_attn", max_batch_tokens=32768, max_batch_requests=64,
                        kv_cache_memory=0.5, enable_prefix_caching=False, worker_timeout=300.0),
        ),
        port=50052,
        max_concurrent_requests=1024,
        metrics_port=9100,
    )  # fmt: skip
    assert isinstance(config.models[1].worker_timeout, float)


def test_flags_override_server_and_defaults_but_not_a_models_own_keys(tmp_path):
    config = load(
        tmp_path,
        TWO_MODELS,
        "--port",
        "6000",
        "--dtype",
        "float16",
        "--max-batch-requests",
        "8",
        "--device",
        "cuda:1",
        "--max-client-batch-size",
        "32",
    )
    assert (config.port, config.max_concurrent_requests, config.max_client_batch_size) == (6000, 1024, 32)
    cpu, gpu = config.models
    # The flags beat defaults: ...
    assert (cpu.dtype, cpu.max_batch_requests, gpu.max_batch_requests) == ("float16", 8, 8)
    # ... and a model's own entry beats the flags.
    assert (cpu.device, gpu.device, gpu.dtype) == ("cpu", "cuda:0", "bfloat16")


def test_a_file_without_models_serves_the_model_flags_with_its_defaults(tmp_path):
    text = "defaults:\n  device: cuda\n  kv_cache_memory: 2GiB\nserver:\n  host: 0.0.0.0\n"
    config = load(
        tmp_path,
        text,
        "--model",
        "/models/a",
        "--model",
        "/models/b",
        "--served-model-name",
        "x",
        "--served-model-name",
        "y",
    )
    assert [(m.path, m.served_name, m.device, m.kv_cache_memory) for m in config.models] == [
        ("/models/a", "x", "cuda", 2 * 2**30),
        ("/models/b", "y", "cuda", 2 * 2**30),
    ]
    assert config.host == "0.0.0.0"


def test_an_empty_file_changes_nothing(tmp_path):
    assert load(tmp_path, "", "--model", "/models/m") == ServerConfig(models=(ModelConfig("/models/m", "m"),))


def test_anchors_and_merge_keys_share_options(tmp_path):
    text = """
    models:
      - &gpu {path: /models/a, device: cuda, dtype: bfloat16}
      - <<: *gpu
        path: /models/b
        dtype: float16
    """
    a, b = load(tmp_path, text).models
    assert (a.device, a.dtype, b.path, b.device, b.dtype) == ("cuda", "bfloat16", "/models/b", "cuda", "float16")


def test_the_api_key_flag_beats_the_environment_which_beats_the_file(tmp_path, monkeypatch):
    text = "server:\n  api_key: from-file\n"
    assert load(tmp_path, text, "--model", "/m").api_key == "from-file"
    monkeypatch.setenv("EMBEDSERV_API_KEY", "from-env")
    assert load(tmp_path, text, "--model", "/m").api_key == "from-env"
    assert load(tmp_path, text, "--model", "/m", "--api-key", "from-flag").api_key == "from-flag"


BAD_FILES = {
    "unknown-top-level-key": (
        "model:\n  - path: /m\n",
        ["unknown key 'model'", "did you mean 'models'?", "valid keys: server, defaults, models"],
    ),
    "unknown-server-key": (
        "server:\n  max_concurent_requests: 5\n",
        ["server: unknown key 'max_concurent_requests'", "did you mean 'max_concurrent_requests'", "host, port"],
    ),
    "unknown-model-key": (
        "models:\n  - path: /m\n  - path: /n\n    max_batch_token: 5\n",
        ["models[1] (/n): unknown key 'max_batch_token'", "did you mean 'max_batch_tokens'"],
    ),
    "dashed-model-key": ("models:\n  - path: /m\n    max-batch-tokens: 5\n", ["did you mean 'max_batch_tokens'"]),
    "unknown-default-key": ("defaults:\n  devise: cpu\n", ["defaults: unknown key 'devise'", "did you mean 'device'"]),
    "model-option-under-server": (
        "server:\n  device: cuda\n",
        ["server: unknown key 'device'", "put it under defaults: for every model, or in a model's entry"],
    ),
    "server-setting-in-a-model": (
        "models:\n  - path: /m\n    port: 1\n",
        ["models[0] (/m): unknown key 'port'", "put it under server:"],
    ),
    "path-in-defaults": ("defaults:\n  path: /m\n", ["defaults: unknown key 'path'", "in that model's entry"]),
    "string-for-an-int": (
        "models:\n  - path: /m\n    max_batch_tokens: lots\n",
        ["models[0] (/m): max_batch_tokens must be an integer or null, not 'lots' (str)"],
    ),
    "bool-for-an-int": ("server:\n  port: true\n", ["server: port must be an integer, not True (bool)"]),
    "float-for-an-int": ("defaults:\n  kv_block_size: 1.5\n", ["defaults: kv_block_size must be an integer"]),
    "int-for-a-bool": ("defaults:\n  allow_pickle: 1\n", ["allow_pickle must be true or false, not 1 (int)"]),
    "null-for-a-required-value": ("server:\n  host: null\n", ["server: host must be a string, not None (null)"]),
    "number-for-a-string": (
        "models:\n  - path: /m\n    served_name: 2024\n",
        ["served_name must be a string", "quote it"],
    ),
    "bad-value-in-a-model": (
        "models:\n  - path: /m\n  - path: /q\n    dtype: fp8\n",
        ["models[1] (/q): dtype must be one of auto, float32, bfloat16, float16, not 'fp8'"],
    ),
    "bad-value-in-defaults": (
        "defaults:\n  device: gpu\nmodels:\n  - path: /m\n",
        ["defaults: device must be cpu, cuda or cuda:N, not 'gpu'"],
    ),
    "bad-value-in-server": ("server:\n  port: 70000\n", ["server: port must be in 0..65535, not 70000"]),
    "two-server-values-that-conflict": (
        "server:\n  max_client_batch_size: 600\n",
        ["server: max_client_batch_size 600 exceeds --max-concurrent-requests 512"],
    ),
    "bad-memory-size": (
        "models:\n  - path: /m\n    kv_cache_memory: 2 gallons\n",
        ["models[0] (/m): kv_cache_memory '2 gallons' is not a size"],
    ),
    "bad-cache-size": (
        "models:\n  - path: /m\n    embedding_cache: lots\n",
        ["models[0] (/m): embedding_cache 'lots' is not a size"],
    ),
    "negative-cache-size": (
        "defaults:\n  embedding_cache: -1\nmodels:\n  - path: /m\n",
        ["defaults: embedding_cache must be 0 (none) or more bytes, not -1"],
    ),
    "duplicate-served-names": (
        "models:\n  - path: /a/m\n  - path: /b/m\n",
        ["embedserv.yaml: served model names must be unique; repeated: m"],
    ),
    "models-not-a-list": ("models:\n  path: /m\n", ["models must be a list of models"]),
    "models-empty": ("models: []\n", ["models must be a list of models"]),
    "model-without-path": ("models:\n  - device: cpu\n", ["models[0] needs a path"]),
    "model-not-a-mapping": ("models:\n  - /m\n", ["models[0] must be a mapping with at least a path, not str"]),
    "server-not-a-mapping": ("server: 50051\n", ["server must be a mapping of key: value, not int"]),
    "top-level-list": ("- path: /m\n", ["the top level must be a mapping"]),
    "duplicate-key": (
        "models:\n  - path: /m\n    device: cpu\n    device: cuda\n",
        ["embedserv.yaml:4:5: not valid YAML: key 'device' is given twice"],
    ),
    "not-yaml": ("models: [\n", ["embedserv.yaml:2:1: not valid YAML: while parsing a flow node; expected"]),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_is_refused_naming_the_file_and_what_to_change(tmp_path, case):
    text, expected = BAD_FILES[case]
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, *([] if "models" in text else ["--model", "/m"]))
    message = str(caught.value)
    assert message.startswith(str(tmp_path / "embedserv.yaml")), message
    for part in expected:
        assert part in message


def test_the_embedding_cache_is_a_size_per_model(tmp_path):
    text = (
        "defaults:\n  embedding_cache: 1GB\nmodels:\n  - path: /a\n  - path: /b\n    embedding_cache: 0\n"
        "  - path: /c\n    embedding_cache: 1048576\n"
    )
    assert [m.embedding_cache for m in load(tmp_path, text).models] == [10**9, 0, 2**20]
    flagged = load(
        tmp_path, "models:\n  - path: /a\n  - path: /b\n    embedding_cache: 1KiB\n", "--embedding-cache", "256MiB"
    )
    assert [m.embedding_cache for m in flagged.models] == [256 * 2**20, 1024]
    assert load(tmp_path, "", "--model", "/m").models[0].embedding_cache == 0
    for bad in ("big", "-1MiB", "inf", "nan"):
        with pytest.raises(ConfigError, match=rf"^--embedding-cache '{bad}' is not a size"):
            load(tmp_path, "", "--model", "/m", f"--embedding-cache={bad}")


def test_a_bad_flag_is_still_named_as_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^--max-batch-requests must be at least 1, not 0$"):
        load(tmp_path, "models:\n  - path: /m\n", "--max-batch-requests", "0")
    with pytest.raises(ConfigError, match=r"^--port must be in 0\.\.65535"):
        load(tmp_path, "server:\n  port: 1\n", "--model", "/m", "--port", "99999")


def test_model_flags_and_file_models_do_not_mix(tmp_path):
    for flags, flag in ((["--model", "/x"], "--model"), (["--served-model-name", "x"], "--served-model-name")):
        with pytest.raises(ConfigError, match=f"{flag} cannot be combined with the models: of --config"):
            load(tmp_path, "models:\n  - path: /m\n", *flags)


def test_a_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"--config {missing}: cannot read it"):
        server_config(build_parser().parse_args(["serve", "--config", str(missing)]))


def test_help_says_how_flags_and_file_combine():
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    text = " ".join(serve.format_help().split())
    assert "Flags given here override the --config file's server: settings and its defaults:" in text
    assert "a model's own keys in the file override the flags" in text


def test_the_documented_example_is_a_valid_file(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    example = readme.split("```yaml\n# embedserv.yaml\n", 1)[1].split("```", 1)[0]
    cpu, gpu = load(tmp_path, example).models
    assert (cpu.device, gpu.device, gpu.dtype, gpu.attention_backend) == ("cpu", "cuda:0", "bfloat16", "flash_attn")
    assert (cpu.batch_token_budget, gpu.batch_token_budget) == (4096, 16384)
