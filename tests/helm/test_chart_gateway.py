"""The InferencePool for an inference gateway, the GPU values, the tracing and auto-truncate flags, and the
chart README's values table.

Kept beside test_chart.py, whose helpers it uses, so that each file stays within 400 lines.
"""

from __future__ import annotations

import copy
import re

import helm_python as helm
import pytest
import yaml

from embedserv.cli import build_parser, server_config
from tests.helm.crd_schema import validate_custom
from tests.helm.test_chart import (  # noqa: F401 (chart is a fixture)
    CHART_DIR,
    FULLNAME,
    NAMESPACE,
    chart,
    flag,
    one,
    pod_spec,
    render,
    render_raw,
    server,
)

POOL = {"inferencePool": {"enabled": True, "endpointPicker": {"name": "embed-epp"}}}


# The InferencePool.


def test_inference_pool_selects_the_release_pods_on_the_http_port(chart):
    objects = render(chart, POOL)
    pool = one(objects, "InferencePool")
    validate_custom(pool)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    deployment = one(objects, "Deployment")
    assert spec["selector"] == deployment["spec"]["selector"]
    assert spec["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    http = {p["name"]: p["containerPort"] for p in server(objects)["ports"]}["http"]
    assert spec["targetPorts"] == [{"number": http}] and spec["appProtocol"] == "http"
    # The CRD's CEL rule, which jsonschema cannot run: a Service reference needs its port.
    assert spec["endpointPickerRef"] == {
        "kind": "Service",
        "name": "embed-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }


def test_inference_pool_values(chart):
    values = {
        "service": {"httpPort": 8080},
        "inferencePool": {
            "enabled": True,
            "name": "embeddings",
            "endpointPicker": {"name": "epp", "port": 9003, "failureMode": "FailOpen"},
        },
    }
    pool = one(render(chart, values), "InferencePool", "embeddings")
    validate_custom(pool)
    assert pool["metadata"]["namespace"] == NAMESPACE
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9003}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert not [o for o in render(chart, {}) if o["kind"] == "InferencePool"]


def test_inference_pool_needs_http(chart):
    with pytest.raises(
        helm.HelmRenderError, match=re.escape("inferencePool.enabled routes HTTP to the pods: set service.httpPort")
    ):
        render_raw(chart, {**POOL, "service": {"httpPort": 0}})


@pytest.mark.parametrize(
    "values",
    [
        {"inferencePool": {"enabled": True}},
        {"inferencePool": {"enabled": True, "endpointPicker": {"name": ""}}},
        {"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp", "failureMode": "FailSometimes"}}},
        {"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp", "port": 0}}},
        {"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp", "kind": "Deployment"}}},
    ],
    ids=["no-picker", "empty-picker", "failure-mode", "port-0", "unknown-key"],
)
def test_schema_rejects_bad_pool_values(chart, values):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(copy.deepcopy(values))


# GPU values.


def test_gpu_resource_name_and_node_selector(chart):
    values = {
        "gpu": {
            "enabled": True,
            "resourceName": "amd.com/gpu",
            "count": 2,
            "nodeSelector": {"amd.com/gpu.product-name": "MI300X", "pool": "gpu"},
        },
        "nodeSelector": {"pool": "inference", "zone": "a"},
    }
    objects = render(chart, values)
    limits = server(objects)["resources"]["limits"]
    assert limits["amd.com/gpu"] == 2 and "nvidia.com/gpu" not in limits
    # nodeSelector wins on a key both set.
    assert pod_spec(objects)["nodeSelector"] == {"amd.com/gpu.product-name": "MI300X", "pool": "inference", "zone": "a"}
    assert flag(server(objects)["args"], "--device") == "cuda"


def test_gpu_node_selector_only_with_gpu(chart):
    values = {"gpu": {"nodeSelector": {"nvidia.com/gpu.present": "true"}}}
    assert "nodeSelector" not in pod_spec(render(chart, values))
    assert pod_spec(render(chart, {**values, "nodeSelector": {"a": "b"}}))["nodeSelector"] == {"a": "b"}
    on = pod_spec(render(chart, {"gpu": {"enabled": True, **values["gpu"]}}))
    assert on["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # The default stays nvidia.com/gpu and selects no nodes, as before these values existed.
    default_gpu = render(chart, {"gpu": {"enabled": True}})
    assert server(default_gpu)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nodeSelector" not in pod_spec(default_gpu)


@pytest.mark.parametrize(
    "values",
    [
        {"gpu": {"resourceName": "gpu"}},
        {"gpu": {"resourceName": "nvidia.com/"}},
        {"gpu": {"nodeSelector": {"nvidia.com/gpu.present": True}}},
    ],
    ids=["resource-without-domain", "resource-without-name", "selector-not-a-string"],
)
def test_schema_rejects_bad_gpu_values(chart, values):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(copy.deepcopy(values))


# Tracing and auto-truncate reach the server as the flags it parses.


def parsed(args: list[str]):
    return server_config(build_parser().parse_args(["serve", *args]))


def test_server_flags_for_tracing_and_auto_truncate(chart):
    default = server(render(chart, {}))["args"]
    assert not {"--auto-truncate", "--no-auto-truncate", "--otlp-endpoint"} & set(default)
    assert parsed(default).otlp_endpoint is None
    values = {
        "server": {"autoTruncate": True, "otlpEndpoint": "http://otel-collector.observability:4317"},
        "extraEnv": [{"name": "OTEL_SERVICE_NAME", "value": "embed"}],
    }
    container = server(render(chart, values))
    config = parsed(container["args"])
    assert config.otlp_endpoint == "http://otel-collector.observability:4317"
    assert [m.auto_truncate for m in config.models] == [True]
    assert {"name": "OTEL_SERVICE_NAME", "value": "embed"} in container["env"]
    off = server(render(chart, {"server": {"autoTruncate": False}}))["args"]
    assert "--no-auto-truncate" in off and [m.auto_truncate for m in parsed(off).models] == [False]


@pytest.mark.parametrize(
    "values",
    [
        {"server": {"autoTruncate": "yes"}},
        {"server": {"otlpEndpoint": "otel-collector:4317"}},
        {"server": {"otlpEndpoint": ""}},
    ],
    ids=["auto-truncate-string", "otlp-without-scheme", "otlp-empty"],
)
def test_schema_rejects_bad_server_values(chart, values):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(copy.deepcopy(values))


# The README documents every value.


def value_keys(node: dict, prefix: str = "") -> dict[str, bool]:
    """Every key of values.yaml, dotted, and whether it is a leaf (no non-empty map below it)."""
    keys = {}
    for key, value in node.items():
        nested = isinstance(value, dict) and bool(value)
        keys[prefix + key] = not nested
        if nested:
            keys |= value_keys(value, f"{prefix}{key}.")
    return keys


def documented_keys(readme: str) -> set[str]:
    """First cells of the values table; `a.b.c`, `.d` stands for a.b.c and a.b.d."""
    keys = set()
    for line in readme.splitlines():
        if not line.startswith("| `"):
            continue
        previous = ""
        for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
            key = previous.rsplit(".", 1)[0] + key if key.startswith(".") else key
            keys.add(key)
            previous = key
    return keys


def test_readme_documents_every_value():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    documented = documented_keys((CHART_DIR / "README.md").read_text())
    # A key is covered by its own row or by a row for a map it is in (resources, probes.startup, ...).
    keys = value_keys(values)
    missing = [
        k for k, leaf in sorted(keys.items()) if leaf and not any(k == d or k.startswith(d + ".") for d in documented)
    ]
    assert missing == []
    assert not documented - set(keys), "rows for keys values.yaml lacks"
