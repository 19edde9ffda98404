"""Autoscaling on load: the KEDA ScaledObject, the HPA on custom metrics, and the strict CRD check they and
the InferencePool are validated with (tests/helm/crd_schema.py, against the CRDs in tests/helm/crds/).

Kept beside test_chart.py, whose helpers it uses, so that each file stays within 400 lines.
"""

from __future__ import annotations

import copy
import re
from collections import Counter

import helm_python as helm
import jsonschema
import kubernetes_validate as kv
import pytest
import yaml

from tests.helm.crd_schema import CRD_DIR, CRD_FILES, crd_schema, served_schema, validate_custom
from tests.helm.test_chart import (  # noqa: F401 (chart is a fixture)
    BASE_KINDS,
    CHART_DIR,
    FULLNAME,
    KUBE_VERSION,
    NAMESPACE,
    chart,
    one,
    render,
    render_raw,
)

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
KEDA = {"keda": {"enabled": True, "prometheus": {"serverAddress": PROMETHEUS}}}
KEDA_FULL = {
    "keda": {
        "enabled": True,
        "minReplicas": 2,
        "maxReplicas": 10,
        "pollingInterval": 5,
        "cooldownPeriod": 120,
        "prometheus": {
            "serverAddress": PROMETHEUS,
            "threshold": 1000000,
            "activationThreshold": 2.5,
            "authenticationRef": {"name": "prom-auth", "kind": "ClusterTriggerAuthentication"},
            "authModes": "bearer",
        },
        "fallback": {"failureThreshold": 3, "replicas": 4},
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
    }
}
POD_METRICS = [
    {"name": "embedserv_requests_waiting", "averageValue": 4},
    {"name": "embedserv_waiting_tokens", "averageValue": "8k", "selector": {"matchLabels": {"model": "bge-m3"}}},
]
EXTERNAL = {
    "type": "External",
    "external": {
        "metric": {"name": "gateway_requests_per_second"},
        "target": {"type": "AverageValue", "averageValue": "50"},
    },
}
CUSTOM_HPA = {
    "autoscaling": {
        "enabled": True,
        "targetCPUUtilizationPercentage": None,
        "podMetrics": POD_METRICS,
        "extraMetrics": [EXTERNAL],
    }
}
POOL = {"inferencePool": {"enabled": True, "endpointPicker": {"name": "embed-epp"}}}
CASES = {
    "keda": (KEDA, BASE_KINDS + Counter({"ScaledObject": 1})),
    "keda-full": (KEDA_FULL, BASE_KINDS + Counter({"ScaledObject": 1})),
    "custom-metrics-hpa": (CUSTOM_HPA, BASE_KINDS + Counter({"HorizontalPodAutoscaler": 1})),
    "inference-pool": (POOL, BASE_KINDS + Counter({"InferencePool": 1})),
    "keda-and-pool": ({**KEDA, **POOL}, BASE_KINDS + Counter({"ScaledObject": 1, "InferencePool": 1})),
}
CUSTOM_KINDS = {"ScaledObject", "InferencePool"}
# The alphabet of pod-template hashes and generated name suffixes (k8s.io/apimachinery/pkg/util/rand).
POD_ID = "[bcdfghjklmnpqrstvwxz2456789]"


# Every object is valid: Kubernetes kinds against 1.30, ours against the vendored CRDs, strictly.


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_is_valid(chart, case):
    values, kinds = CASES[case]
    objects = render(chart, values)
    assert Counter(o["kind"] for o in objects) == kinds
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            with pytest.raises(kv.SchemaNotFoundError):
                kv.validate(obj, KUBE_VERSION, strict=True)
            validate_custom(obj)
        else:
            kv.validate(obj, KUBE_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean_and_schema_accepts(chart, case):
    values = CASES[case][0]
    chart.validate_schema(copy.deepcopy(values))
    report = helm.lint(CHART_DIR, values=copy.deepcopy(values), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_vendored_crds_are_the_versions_the_chart_renders():
    for (group, kind), name in CRD_FILES.items():
        crd = yaml.safe_load((CRD_DIR / name).read_text())
        assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind)
        readme = (CRD_DIR / "README.md").read_text()
        assert re.search(f"`{re.escape(name)}` from \\S+,\\s+commit `[0-9a-f]{{40}}`", readme)
    assert crd_schema("keda.sh/v1alpha1", "ScaledObject")["additionalProperties"] is False


@pytest.mark.parametrize(
    "case, path, key",
    [
        ("keda", ["spec"], "maxReplicas"),
        ("keda", ["spec", "triggers", 0], "authRef"),
        ("keda", ["spec", "scaleTargetRef"], "deployment"),
        ("inference-pool", ["spec"], "targetPort"),
        ("inference-pool", ["spec", "endpointPickerRef"], "mode"),
        ("inference-pool", ["spec", "endpointPickerRef", "port"], "port"),
    ],
)
def test_the_crd_check_refuses_a_typo_a_cluster_would_prune(chart, case, path, key):
    """The CRD as vendored accepts the typo (a cluster drops it silently); the strict check does not."""
    obj = next(o for o in render(chart, CASES[case][0]) if o["kind"] in CUSTOM_KINDS)
    validate_custom(obj)
    node = obj
    for step in path:
        node = node[step]
    node[key] = 1
    jsonschema.validate(obj, served_schema(obj["apiVersion"], obj["kind"]))
    with pytest.raises(jsonschema.ValidationError, match=f"'{key}' was unexpected"):
        validate_custom(obj)


@pytest.mark.parametrize(
    "case, path, value",
    [
        ("keda", ["spec", "minReplicaCount"], "two"),
        ("keda", ["spec", "triggers", 0, "metadata", "threshold"], 8),
        ("inference-pool", ["spec", "endpointPickerRef", "failureMode"], "FailSometimes"),
        ("inference-pool", ["spec", "targetPorts"], []),
    ],
)
def test_the_crd_check_refuses_wrong_values(chart, case, path, value):
    obj = next(o for o in render(chart, CASES[case][0]) if o["kind"] in CUSTOM_KINDS)
    node = obj
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(obj)


# KEDA.


def test_keda_scales_the_deployment_on_the_load_metrics(chart):
    objects = render(chart, KEDA)
    spec = one(objects, "ScaledObject")["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (15, 300)
    assert "fallback" not in spec and "advanced" not in spec
    (trigger,) = spec["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    assert "authenticationRef" not in trigger
    meta = trigger["metadata"]
    assert (meta["serverAddress"], meta["threshold"], meta["activationThreshold"]) == (PROMETHEUS, "4", "0")
    pods = f"{FULLNAME}-{POD_ID}+-{POD_ID}{{5}}"
    names = '__name__=~"embedserv_requests_(waiting|running)"'
    assert meta["query"] == f'sum({{{names},namespace="{NAMESPACE}",pod=~"{pods}"}})'
    assert "replicas" not in one(objects, "Deployment")["spec"]
    assert not [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]


def test_the_default_query_selects_this_releases_pods_only(chart):
    meta = one(render(chart, KEDA), "ScaledObject")["spec"]["triggers"][0]["metadata"]
    # PromQL anchors =~ at both ends, as fullmatch does.
    pods = re.compile(re.search(r'pod=~"([^"]+)"', meta["query"]).group(1))
    assert pods.fullmatch(f"{FULLNAME}-7d9c8b6f5-x2kqp") and pods.fullmatch(f"{FULLNAME}-5f6b7c48d9-z8n2q")
    assert not pods.fullmatch(f"{FULLNAME}-big-7d9c8b6f5-x2kqp")
    assert not pods.fullmatch(f"{FULLNAME}-7d9c8b6f5-x2kqpz")
    test_pod = one(render(chart, KEDA), "Pod", f"{FULLNAME}-test-health")["metadata"]["name"]
    assert not pods.fullmatch(test_pod)
    assert not pods.fullmatch(f"other-{FULLNAME}-7d9c8b6f5-x2kqp")


def test_keda_values_reach_the_scaled_object(chart):
    spec = one(render(chart, KEDA_FULL), "ScaledObject")["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["pollingInterval"], spec["cooldownPeriod"]) == (
        2,
        10,
        5,
        120,
    )
    assert spec["fallback"] == {"failureThreshold": 3, "replicas": 4}
    assert spec["advanced"] == {"horizontalPodAutoscalerConfig": {"behavior": KEDA_FULL["keda"]["behavior"]}}
    (trigger,) = spec["triggers"]
    assert trigger["authenticationRef"] == {"name": "prom-auth", "kind": "ClusterTriggerAuthentication"}
    # Strings, as KEDA reads them; a large number without an exponent.
    meta = trigger["metadata"]
    assert (meta["threshold"], meta["activationThreshold"], meta["authModes"]) == ("1000000", "2.5", "bearer")


def test_keda_takes_a_query_of_its_own_and_then_may_scale_to_zero(chart):
    query = 'sum(rate(gateway_requests_total{pool="embed"}[1m]))'
    values = {
        "keda": {
            "enabled": True,
            "minReplicas": 0,
            "prometheus": {"serverAddress": PROMETHEUS, "query": query, "threshold": 20},
        }
    }
    objects = render(chart, values)
    spec = one(objects, "ScaledObject")["spec"]
    assert spec["minReplicaCount"] == 0 and spec["triggers"][0]["metadata"]["query"] == query
    validate_custom(one(objects, "ScaledObject"))


@pytest.mark.parametrize(
    "values, message",
    [
        ({**KEDA, "autoscaling": {"enabled": True}}, "keda.enabled and autoscaling.enabled both scale the Deployment"),
        ({"keda": {**KEDA["keda"], "minReplicas": 0}}, "keda.minReplicas 0 needs keda.prometheus.query"),
        ({"keda": {**KEDA["keda"], "minReplicas": 5, "maxReplicas": 2}}, "keda.minReplicas must not exceed"),
        (
            {"keda": {"enabled": True, "prometheus": {"serverAddress": PROMETHEUS, "authModes": "bearer"}}},
            "authModes needs keda.prometheus.authenticationRef",
        ),
        (
            {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None}},
            "autoscaling.enabled needs a metric",
        ),
    ],
    ids=[
        "keda-beside-hpa",
        "keda-zero-on-own-metrics",
        "keda-min-above-max",
        "keda-auth-modes-alone",
        "hpa-without-metrics",
    ],
)
def test_render_refuses_contradictions(chart, values, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render_raw(chart, values)


@pytest.mark.parametrize(
    "values",
    [
        {"keda": {"enabled": True}},
        {"keda": {"enabled": True, "prometheus": {"serverAddress": ""}}},
        {"keda": {**KEDA["keda"], "prometheus": {"serverAddress": "prometheus:9090"}}},
        {"keda": {**KEDA["keda"], "prometheus": {"serverAddress": PROMETHEUS, "threshold": 0}}},
        {"keda": {**KEDA["keda"], "prometheus": {"serverAddress": PROMETHEUS, "treshold": 4}}},
        {
            "keda": {
                **KEDA["keda"],
                "prometheus": {"serverAddress": PROMETHEUS, "authenticationRef": {"name": "a", "kind": "Secret"}},
            }
        },
        {"keda": {**KEDA["keda"], "minReplicas": -1}},
        {"autoscaling": {"podMetrics": [{"name": "embedserv_requests_waiting"}]}},
        {"autoscaling": {"podMetrics": [{"name": "embedserv_requests_waiting", "averageValue": "lots"}]}},
        {"autoscaling": {"podMetrics": [{"name": "embedserv_requests_waiting", "averageValue": 0}]}},
        {"autoscaling": {"extraMetrics": [{"external": {}}]}},
    ],
    ids=[
        "keda-without-prometheus",
        "keda-empty-address",
        "keda-address-without-scheme",
        "keda-threshold-0",
        "keda-typo",
        "keda-auth-kind",
        "keda-min-negative",
        "pod-metric-without-target",
        "pod-metric-not-quantity",
        "pod-metric-zero",
        "extra-metric-without-type",
    ],
)
def test_schema_rejects_bad_autoscaling_values(chart, values):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(copy.deepcopy(values))


# The HPA on custom and external metrics.


def test_hpa_scales_on_pod_and_external_metrics(chart):
    objects = render(chart, CUSTOM_HPA)
    metrics = one(objects, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metrics == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "embedserv_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        },
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "embedserv_waiting_tokens", "selector": {"matchLabels": {"model": "bge-m3"}}},
                "target": {"type": "AverageValue", "averageValue": "8k"},
            },
        },
        EXTERNAL,
    ]
    assert "replicas" not in one(objects, "Deployment")["spec"]


def test_hpa_adds_pod_metrics_to_cpu(chart):
    values = {"autoscaling": {"enabled": True, "podMetrics": POD_METRICS[:1]}}
    metrics = one(render(chart, values), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Resource", "Pods"]
    assert metrics[0]["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}
