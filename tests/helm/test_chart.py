"""The Helm chart, rendered offline by real Helm (helm_python) and checked object by object.

Every rendered object is validated against the Kubernetes 1.30 schemas (strict: unknown fields fail);
the ServiceMonitor, a CRD those schemas lack, against our own strict schema next to this file.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate as kv
import pytest
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "embedserv"
SERVICEMONITOR_SCHEMA = json.loads((Path(__file__).parent / "servicemonitor.schema.json").read_text())
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "es", "ml"
FULLNAME = "es-embedserv"

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
FULL = {
    "gpu": {"enabled": True, "count": 2},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetMemoryUtilizationPercentage": 80},
    "podDisruptionBudget": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}, "interval": "15s"},
    "model": {"source": "pvc", "name": "bge-m3", "pvc": {"claimName": "models", "subPath": "bge-m3"}},
    "apiKey": {"existingSecret": "es-api-key"},
    "server": {
        "maxBatchTokens": 8192,
        "dataParallelSize": 2,
        "dtype": "bfloat16",
        "drainTimeout": 60,
        "extraArgs": ["--attention-backend", "sdpa"],
    },
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    ],
}
IMAGE_SOURCE = {
    "model": {"source": "image", "image": {"repository": "registry.example/models/bge", "tag": "v1"}},
    "apiKey": {"value": "s3cret-key-value"},
}
HOSTPATH_SOURCE = {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/models/e5"}}}

BASE_KINDS = Counter({"Deployment": 1, "Service": 2, "ServiceAccount": 1, "Pod": 1})
CASES = {
    "default": ({}, BASE_KINDS),
    "gpu-full": (
        FULL,
        BASE_KINDS + Counter({"HorizontalPodAutoscaler": 1, "PodDisruptionBudget": 1, "ServiceMonitor": 1}),
    ),
    "image-source-with-key": (IMAGE_SOURCE, BASE_KINDS + Counter({"Secret": 1})),
    "hostpath-source": (HOSTPATH_SOURCE, BASE_KINDS),
}
BAD_VALUES = {
    "gpu-count-0": {"gpu": {"count": 0}},
    "dtype-fp8": {"server": {"dtype": "fp8"}},
    "quantization-int4": {"server": {"quantization": "int4"}},
    "cpu-fusion-fast": {"server": {"cpuFusion": "fast"}},
    "cpu-allocator-jemalloc": {"server": {"cpuAllocator": "jemalloc"}},
    "frontends-negative": {"server": {"frontends": -1}},
    "embedding-cache-negative": {"server": {"embeddingCache": -1}},
    "embedding-cache-not-a-size": {"server": {"embeddingCache": "lots"}},
    "unknown-top-level-key": {"replicas": 3},
    "model-source-s3": {"model": {"source": "s3"}},
    "typo-in-server": {"server": {"maxBatchToken": 8192}},
    "replicas-0": {"replicaCount": 0},
    "port-too-big": {"service": {"grpcPort": 70000}},
    "log-format-xml": {"server": {"logFormat": "xml"}},
    "pvc-without-claim": {"model": {"source": "pvc"}},
    "pdb-with-neither": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": None}},
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render_raw(chart, values: dict) -> dict[str, str]:
    return chart.render(values=copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)


def render(chart, values: dict) -> list[dict]:
    objects = []
    for path, text in render_raw(chart, values).items():
        if path.endswith("NOTES.txt"):
            continue
        objects += [obj for obj in yaml.safe_load_all(text) if obj]
    return objects


def one(objects: list[dict], kind: str, name: str = FULLNAME) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def pod_spec(objects: list[dict]) -> dict:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def server(objects: list[dict]) -> dict:
    (container,) = pod_spec(objects)["containers"]
    return container


def flag(args: list[str], name: str) -> str | None:
    """The value after flag `name`, or None when the flag is absent."""
    return args[args.index(name) + 1] if name in args else None


# Every object is schema-valid, none skipped.


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_is_valid(chart, case):
    values, kinds = CASES[case]
    objects = render(chart, values)
    assert Counter(o["kind"] for o in objects) == kinds
    checked = 0
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            with pytest.raises(kv.SchemaNotFoundError):
                kv.validate(obj, KUBE_VERSION, strict=True)
            jsonschema.validate(obj, SERVICEMONITOR_SCHEMA)
        else:
            kv.validate(obj, KUBE_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE
        checked += 1
    assert checked == sum(kinds.values())


def test_servicemonitor_schema_is_strict():
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "x", "namespace": "ml", "labels": {}},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"port": "metrics"}]},
    }
    jsonschema.validate(monitor, SERVICEMONITOR_SCHEMA)
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICEMONITOR_SCHEMA)


@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean(case):
    report = helm.lint(CHART_DIR, values=copy.deepcopy(CASES[case][0]), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_metadata(chart):
    meta = chart.metadata
    assert (meta["apiVersion"], meta["name"], meta["version"], meta["appVersion"]) == (
        "v2",
        "embedserv",
        "0.1.0",
        "0.1.0",
    )
    assert meta["kubeVersion"] == ">=1.30.0-0" and meta["type"] == "application"


# values.schema.json.


@pytest.mark.parametrize("case", CASES)
def test_schema_accepts_good_values(chart, case):
    chart.validate_schema(copy.deepcopy(CASES[case][0]))


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_schema_rejects_bad_values(chart, bad):
    values = BAD_VALUES[bad]
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(copy.deepcopy(values))
    with pytest.raises(helm.HelmValuesError):
        render_raw(chart, values)
    report = helm.lint(CHART_DIR, values=copy.deepcopy(values), strict=True, kube_version="v1.30.0")
    assert any(m["severity"] == 3 for m in report["messages"])


@pytest.mark.parametrize(
    "values",
    [
        {"apiKey": {"existingSecret": "a", "value": "b"}},
        {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
        {"model": {"lora": {"a": "/models/a"}}, "config": {"models": [{"path": "/models/m"}]}},
    ],
    ids=["two-key-sources", "hpa-min-above-max", "lora-beside-config-models"],
)
def test_render_refuses_contradictions(chart, values):
    with pytest.raises(helm.HelmRenderError):
        render_raw(chart, values)


# Behaviour of the rendered objects.


@pytest.mark.parametrize("case", ["default", "gpu-full"])
def test_probes_are_grpc_health_on_the_grpc_port(chart, case):
    container = server(render(chart, CASES[case][0]))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9090, "http": 8000}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": ports["grpc"], "service": ""}, probe
        assert "httpGet" not in container[probe] and "exec" not in container[probe]
    startup = container["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600
