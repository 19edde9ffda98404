"""The Helm chart's pods and what surrounds them: device, scaling, budgets, services, security, the server's
arguments, secrets, model sources, the drain and the chart's test pod (rendered as in test_chart.py).
"""

from __future__ import annotations

import base64

import pytest

from tests.helm.test_chart import (  # noqa: F401 (chart is a fixture)
    FULL,
    FULLNAME,
    GPU_TOLERATION,
    HOSTPATH_SOURCE,
    IMAGE_SOURCE,
    chart,
    flag,
    one,
    pod_spec,
    render,
    render_raw,
    server,
)


def test_default_is_cpu(chart):
    objects = render(chart, {})
    spec, container = pod_spec(objects), server(objects)
    assert flag(container["args"], "--device") == "cpu"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) & set(container["resources"]["limits"])
    assert "tolerations" not in spec
    assert container["image"] == "ghcr.io/embedserv/embedserv:0.1.0-cpu"


def test_gpu_values(chart):
    objects = render(chart, FULL)
    spec, container = pod_spec(objects), server(objects)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == FULL["gpu"]["count"]
    assert flag(container["args"], "--device") == "cuda"
    assert GPU_TOLERATION in spec["tolerations"]
    assert FULL["tolerations"][0] in spec["tolerations"]
    assert container["image"] == "ghcr.io/embedserv/embedserv:0.1.0-cuda"
    tagged = server(render(chart, {"gpu": {"enabled": True}, "image": {"tag": "dev"}}))
    assert tagged["image"] == "ghcr.io/embedserv/embedserv:dev"


def test_hpa_owns_the_replica_count(chart):
    objects = render(chart, FULL)
    hpa = one(objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    targets = {m["resource"]["name"]: m["resource"]["target"]["averageUtilization"] for m in hpa["metrics"]}
    assert targets == {"cpu": 70, "memory": 80}
    assert "replicas" not in one(objects, "Deployment")["spec"]
    assert one(render(chart, {"replicaCount": 3}), "Deployment")["spec"]["replicas"] == 3


@pytest.mark.parametrize(
    "pdb_values, expected",
    [
        ({}, {"maxUnavailable": 1}),
        ({"minAvailable": 1}, {"minAvailable": 1}),
        ({"minAvailable": "50%", "maxUnavailable": None}, {"minAvailable": "50%"}),
        ({"maxUnavailable": "25%"}, {"maxUnavailable": "25%"}),
    ],
)
def test_pdb_has_exactly_one_budget(chart, pdb_values, expected):
    objects = render(chart, {"podDisruptionBudget": {"enabled": True, **pdb_values}})
    spec = one(objects, "PodDisruptionBudget")["spec"]
    assert {k: v for k, v in spec.items() if k in ("minAvailable", "maxUnavailable")} == expected
    assert spec["selector"] == one(objects, "Deployment")["spec"]["selector"]


def test_services(chart):
    objects = render(chart, {})
    selector = one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    svc = one(objects, "Service")["spec"]
    assert svc["type"] == "ClusterIP" and svc["selector"] == selector
    ports = {p["name"]: (p["port"], p["targetPort"], p.get("appProtocol")) for p in svc["ports"]}
    assert ports == {
        "grpc": (50051, "grpc", "grpc"),
        "metrics": (9090, "metrics", "http"),
        "http": (8000, "http", "http"),
    }
    headless = one(objects, "Service", f"{FULLNAME}-headless")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    assert headless["selector"] == selector
    assert [(p["name"], p["port"]) for p in headless["ports"]] == [("grpc", 50051), ("http", 8000)]


def test_servicemonitor_scrapes_only_the_clusterip_service(chart):
    objects = render(chart, FULL)
    monitor = one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "15s")
    match = monitor["spec"]["selector"]["matchLabels"].items()
    assert match <= one(objects, "Service")["metadata"]["labels"].items()
    assert not match <= one(objects, "Service", f"{FULLNAME}-headless")["metadata"]["labels"].items()


def test_hardened_security_context(chart):
    objects = render(chart, IMAGE_SOURCE)
    spec = pod_spec(objects)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert {spec["securityContext"][k] for k in ("runAsUser", "runAsGroup", "fsGroup")} == {10001}
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    assert one(objects, "ServiceAccount")["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == FULLNAME
    for container in spec["containers"] + spec["initContainers"]:
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert "emptyDir" in volumes["tmp"]
    mounts = {m["mountPath"]: m["name"] for m in server(objects)["volumeMounts"]}
    assert mounts["/tmp"] == "tmp" and mounts["/dev/shm"] == "shm"
    env = {e["name"]: e.get("value") for e in server(objects)["env"]}
    assert env["HOME"] == "/tmp" and env["HF_HUB_OFFLINE"] == "1"


def test_args_carry_values_and_omit_unset_ones(chart):
    args = server(render(chart, FULL))["args"]
    assert all(isinstance(a, str) for a in args)
    expected = {
        "--host": "0.0.0.0",
        "--port": "50051",
        "--metrics-port": "9090",
        "--http-port": "8000",
        "--max-batch-tokens": "8192",
        "--data-parallel-size": "2",
        "--dtype": "bfloat16",
        "--drain-timeout": "60",
        "--log-format": "json",
        "--log-level": "info",
        "--attention-backend": "sdpa",
        "--max-connection-age": "60",
    }
    assert {f: flag(args, f) for f in expected} == expected
    assert args[-2:] == ["--attention-backend", "sdpa"]
    for absent in ("--max-concurrent-requests", "--max-client-batch-size", "--api-key"):
        assert absent not in args
    default_args = server(render(chart, {}))["args"]
    for absent in (
        "--model",
        "--served-model-name",
        "--dtype",
        "--quantization",
        "--max-batch-tokens",
        "--data-parallel-size",
        "--max-concurrent-requests",
        "--max-client-batch-size",
    ):
        assert absent not in default_args
    assert flag(server(render(chart, {"server": {"quantization": "int8"}}))["args"], "--quantization") == "int8"
    assert flag(server(render(chart, {"server": {"cpuFusion": "eager"}}))["args"], "--cpu-fusion") == "eager"
    assert "--cpu-fusion" not in default_args
    assert flag(server(render(chart, {"server": {"cpuAllocator": "glibc"}}))["args"], "--cpu-allocator") == "glibc"
    assert flag(server(render(chart, {"server": {"frontends": 2}}))["args"], "--frontends") == "2"
    assert "--frontends" not in default_args
    big = server(
        render(chart, {"server": {"maxConcurrentRequests": 1000000, "logLevel": None, "maxConnectionAge": None}})
    )["args"]
    assert flag(big, "--max-concurrent-requests") == "1000000" and "--log-level" not in big
    assert "--max-connection-age" not in big


def test_api_key_comes_from_a_secret(chart):
    env = {e["name"]: e for e in server(render(chart, FULL))["env"]}
    assert env["EMBEDSERV_API_KEY"] == {
        "name": "EMBEDSERV_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "es-api-key", "key": "api-key"}},
    }
    assert "EMBEDSERV_API_KEY" not in {e["name"] for e in server(render(chart, {}))["env"]}

    key = IMAGE_SOURCE["apiKey"]["value"]
    manifests = render_raw(chart, IMAGE_SOURCE)
    assert not any(key in text for text in manifests.values()), "the key must appear only base64-encoded"
    objects = render(chart, IMAGE_SOURCE)
    secret = one(objects, "Secret", f"{FULLNAME}-api-key")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == key
    ref = {e["name"]: e for e in server(objects)["env"]}["EMBEDSERV_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{FULLNAME}-api-key", "key": "api-key"}


@pytest.mark.parametrize("source", ["bundled", "pvc", "hostPath", "image"])
def test_model_sources(chart, source):
    values = {"bundled": {}, "pvc": FULL, "hostPath": HOSTPATH_SOURCE, "image": IMAGE_SOURCE}[source]
    objects = render(chart, values)
    spec, container = pod_spec(objects), server(objects)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    if source == "bundled":
        assert "model" not in volumes and "model" not in mounts and "--model" not in container["args"]
        assert "initContainers" not in spec
        return
    assert flag(container["args"], "--model") == "/models"
    assert mounts["model"]["mountPath"] == "/models" and mounts["model"]["readOnly"] is True
    model = volumes["model"]
    if source == "pvc":
        assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert mounts["model"]["subPath"] == "bge-m3"
        assert flag(container["args"], "--served-model-name") == "bge-m3"
    elif source == "hostPath":
        assert model["hostPath"] == {"path": "/mnt/models/e5", "type": "Directory"}
        assert "--served-model-name" not in container["args"]
    else:
        assert set(model) == {"name", "emptyDir"}
        (init,) = spec["initContainers"]
        assert init["image"] == "registry.example/models/bge:v1"
        assert init["command"] == ["cp", "-R", "/model/.", "/models"]
        assert [(m["name"], m["mountPath"], m.get("readOnly", False)) for m in init["volumeMounts"]] == [
            ("model", "/models", False)
        ]


@pytest.mark.parametrize("drain, pre_stop", [(30, 5), (120, 0), (0, 10)])
def test_grace_period_outlasts_the_drain(chart, drain, pre_stop):
    values = {"server": {"drainTimeout": drain}, "shutdown": {"preStopSleepSeconds": pre_stop}}
    objects = render(chart, values)
    spec, container = pod_spec(objects), server(objects)
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    assert flag(container["args"], "--drain-timeout") == str(drain)
    if pre_stop:
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop)]
    else:
        assert "lifecycle" not in container


def test_helm_test_pod_checks_health_through_the_service(chart):
    objects = render(chart, FULL)
    pod = one(objects, "Pod", f"{FULLNAME}-test-health")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    svc = one(objects, "Service")
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert container["command"] == ["embedserv-client", "--target", f"{svc['metadata']['name']}:{grpc_port}", "health"]
    assert container["image"] == server(objects)["image"]
    assert pod["spec"]["restartPolicy"] == "Never"
    selector = one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= pod["metadata"]["labels"].items(), "the ReplicaSet would adopt the test pod"


def test_topology_spread_gets_the_selector(chart):
    objects = render(chart, FULL)
    (constraint,) = pod_spec(objects)["topologySpreadConstraints"]
    assert constraint["labelSelector"]["matchLabels"] == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
