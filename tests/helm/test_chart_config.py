"""The chart's `config:` block: the server's --config file as a ConfigMap, checked like every other case
in test_chart.py (Kubernetes schemas, lint, values schema) and read back by the server's own CLI.

Kept beside test_chart.py, whose helpers it uses, so that each file stays within 400 lines.
"""

from __future__ import annotations

import copy
from collections import Counter

import helm_python as helm
import kubernetes_validate as kv
import pytest
import yaml

from embedserv.cli import build_parser, server_config
from tests.helm.test_chart import (  # noqa: F401 (chart is a fixture)
    BASE_KINDS,
    CHART_DIR,
    FULLNAME,
    KUBE_VERSION,
    NAMESPACE,
    chart,
    flag,
    one,
    pod_spec,
    render,
    render_raw,
    server,
)

# A CPU embedder beside a GPU generator whose files are on the volume at /models.
CONFIG_FILE = {
    "gpu": {"enabled": True},
    "model": {"source": "pvc", "pvc": {"claimName": "models"}},
    "config": {
        "server": {"max_concurrent_requests": 1000000, "port": 1},
        "defaults": {"dtype": "float32", "max_batch_requests": 64},
        "models": [
            {"path": "/models/bge-small", "served_name": "bge-small", "device": "cpu", "max_batch_tokens": 4096},
            {"path": "/models/qwen", "dtype": "bfloat16", "attention_backend": "flash_attn", "kv_cache_memory": 0.5},
        ],
    },
}
# Beside --model: the file gives only server settings and defaults for the chart's model.
DEFAULTS_ONLY = {
    "model": {"source": "hostPath", "hostPath": {"path": "/mnt/e5"}, "name": "e5"},
    "config": {"defaults": {"pooling": "mean"}},
}
BAD_CONFIG = {
    "unknown-section": {"config": {"model": [{"path": "/models"}]}},
    "model-without-path": {"config": {"models": [{"device": "cpu"}]}},
    "models-empty": {"config": {"models": []}},
    "server-not-a-mapping": {"config": {"server": 50051}},
}


@pytest.mark.parametrize("values", [CONFIG_FILE, DEFAULTS_ONLY], ids=["models", "defaults-only"])
def test_every_rendered_object_is_valid_and_lint_is_clean(chart, values):
    objects = render(chart, values)
    assert Counter(o["kind"] for o in objects) == BASE_KINDS + Counter({"ConfigMap": 1})
    for obj in objects:
        kv.validate(obj, KUBE_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE
    chart.validate_schema(copy.deepcopy(values))
    report = helm.lint(CHART_DIR, values=copy.deepcopy(values), strict=True, kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("bad", BAD_CONFIG)
def test_schema_rejects_bad_config(chart, bad):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(copy.deepcopy(BAD_CONFIG[bad]))


def test_model_name_beside_config_models_is_refused(chart):
    with pytest.raises(helm.HelmRenderError, match="leave model.name empty"):
        render_raw(chart, {"config": {"models": [{"path": "/models"}]}, "model": {"name": "x"}})


def test_the_config_file_reaches_the_server_as_rendered(chart, tmp_path):
    objects = render(chart, CONFIG_FILE)
    spec, container = pod_spec(objects), server(objects)
    text = one(objects, "ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]
    # Large numbers stay integers (toYaml would write 1e+06, a string to YAML 1.1 readers).
    assert yaml.safe_load(text) == CONFIG_FILE["config"]
    assert {"name": "config", "configMap": {"name": f"{FULLNAME}-config"}} in spec["volumes"]
    assert {"name": "config", "mountPath": "/etc/embedserv", "readOnly": True} in container["volumeMounts"]
    args = container["args"]
    assert "--model" not in args and "--served-model-name" not in args
    assert args[args.index("--config") + 1] == "/etc/embedserv/config.yaml"
    (tmp_path / "config.yaml").write_text(text)
    args[args.index("--config") + 1] = str(tmp_path / "config.yaml")
    config = server_config(build_parser().parse_args(["serve", *args]))
    # The chart's flags win over config.server and config.defaults; each model's own keys over the flags.
    assert (config.port, config.max_concurrent_requests) == (50051, 1000000)
    assert [(m.served_name, m.device, m.dtype, m.max_batch_tokens, m.max_batch_requests) for m in config.models] == [
        ("bge-small", "cpu", "float32", 4096, 64),
        ("qwen", "cuda", "bfloat16", None, 64),
    ]
    assert config.models[1].attention_backend == "flash_attn" and config.models[1].kv_cache_memory == 0.5


def test_a_config_without_models_keeps_the_charts_model(chart):
    args = server(render(chart, DEFAULTS_ONLY))["args"]
    assert args[args.index("--model") + 1] == "/models" and args[args.index("--served-model-name") + 1] == "e5"
    assert "--config" in args


def test_a_changed_config_rolls_the_pods_and_no_config_renders_none(chart):
    def checksum(values: dict) -> str | None:
        annotations = one(render(chart, values), "Deployment")["spec"]["template"]["metadata"].get("annotations", {})
        return annotations.get("checksum/config")

    changed = copy.deepcopy(CONFIG_FILE)
    changed["config"]["defaults"]["dtype"] = "float16"
    assert checksum(CONFIG_FILE) is not None and checksum(changed) not in (None, checksum(CONFIG_FILE))
    objects = render(chart, {"podAnnotations": {"team": "ml"}})
    assert not [o for o in objects if o["kind"] == "ConfigMap"] and "--config" not in server(objects)["args"]
    assert one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"] == {"team": "ml"}
    assert "config" not in {m["name"] for m in server(objects)["volumeMounts"]}


def test_http_port_zero_turns_http_off(chart):
    objects = render(chart, {"service": {"httpPort": 0}})
    container = server(objects)
    assert flag(container["args"], "--http-port") == "0"
    assert "http" not in {p["name"] for p in container["ports"]}
    for service in (one(objects, "Service"), one(objects, "Service", f"{FULLNAME}-headless")):
        assert "http" not in {p["name"] for p in service["spec"]["ports"]}


def test_lora_adapters_become_flags(chart):
    values = {
        "model": {
            "source": "hostPath",
            "hostPath": {"path": "/data/bge"},
            "lora": {"legal": "/models/adapters/legal", "med": "/models/adapters/med"},
        }
    }
    args = server(render(chart, values))["args"]
    loras = [args[i + 1] for i, a in enumerate(args) if a == "--lora"]
    assert loras == ["legal=/models/adapters/legal", "med=/models/adapters/med"]
    assert "--lora" not in server(render(chart, {}))["args"]


def test_embedding_cache_becomes_the_flag_the_server_parses(chart):
    from embedserv.sizes import parse_bytes

    assert "--embedding-cache" not in server(render(chart, {}))["args"]
    for value, expected in (("256MiB", 256 * 2**20), (1073741824, 2**30), (0, 0), ("1GB", 10**9)):
        passed = flag(server(render(chart, {"server": {"embeddingCache": value}}))["args"], "--embedding-cache")
        assert parse_bytes(passed, "--embedding-cache") == expected, (value, passed)


def test_image_limits_become_the_flags_the_server_parses(chart):
    default_args = server(render(chart, {}))["args"]
    for absent in ("--max-images-per-request", "--max-image-bytes", "--max-image-pixels"):
        assert absent not in default_args
    values = {"maxImagesPerRequest": 0, "maxImageBytes": 4 * 2**20, "maxImagePixels": 50_000_000}
    args = server(render(chart, {"server": values}))["args"]
    parsed = server_config(build_parser().parse_args(["serve", "--model", "/m", *_image_flags(args)]))
    assert parsed.max_images_per_request == 0
    assert (parsed.models[0].max_image_bytes, parsed.models[0].max_image_pixels) == (4 * 2**20, 50_000_000)
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"server": {"maxImagesPerRequest": -1}})
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"server": {"maxImageBytes": 0}})


def _image_flags(args: list[str]) -> list[str]:
    names = ("--max-images-per-request", "--max-image-bytes", "--max-image-pixels")
    return [part for name in names for part in (name, flag(args, name))]


def test_named_api_keys_come_from_a_mounted_secret_the_server_reads(chart, tmp_path):
    values = {"apiKeysFile": {"existingSecret": "tenants"}, "apiKey": {"existingSecret": "es-api-key"}}
    objects = render(chart, values)
    spec, container = pod_spec(objects), server(objects)
    secret = {"secretName": "tenants", "items": [{"key": "api-keys.yaml", "path": "api-keys.yaml"}]}
    assert {"name": "api-keys", "secret": secret} in spec["volumes"]
    assert {"name": "api-keys", "mountPath": "/etc/embedserv-api-keys", "readOnly": True} in container["volumeMounts"]
    args = container["args"]
    assert args[args.index("--api-keys-file") + 1] == "/etc/embedserv-api-keys/api-keys.yaml"
    # What the Secret holds, at the path the server is given: two tenants, and the single key named "default".
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(
        "- {name: search, key: sk-search-0123456789, priority: 5}\n- {name: bulk, key: sk-bulk-0123456789}\n"
    )
    args[args.index("--api-keys-file") + 1] = str(keys)
    config = server_config(build_parser().parse_args(["serve", "--api-key", "sk-single-0123456789", *args]))
    assert sorted((key.name, key.priority) for key in config.all_api_keys) == [
        ("bulk", None), ("default", None), ("search", 5)
    ]  # fmt: skip
    plain = render(chart, {})
    assert "--api-keys-file" not in server(plain)["args"]
    assert "api-keys" not in {v["name"] for v in pod_spec(plain)["volumes"]}


def test_the_worker_memory_ceiling_follows_the_pods_memory_limit(chart):
    args = server(render(chart, {}))["args"]  # the default resources have a memory limit
    assert args[args.index("--worker-memory-limit") + 1] == "80%"
    config = server_config(build_parser().parse_args(["serve", *args]))
    assert {m.worker_memory_limit for m in config.models} == {"80%"}
    no_limit = server(render(chart, {"resources": {"requests": {"memory": "1Gi"}, "limits": None}}))["args"]
    assert "--worker-memory-limit" not in no_limit  # a share of no limit: nothing to pass
    sized = server(render(chart, {"resources": {}, "server": {"workerMemoryLimit": "3GiB"}}))["args"]
    assert sized[sized.index("--worker-memory-limit") + 1] == "3GiB"
    assert "--worker-memory-limit" not in server(render(chart, {"server": {"workerMemoryLimit": None}}))["args"]
