"""Validation of custom resources against the CRDs vendored in tests/helm/crds/ (see the README there).

A cluster prunes the fields a structural CRD schema does not list, silently: a typo'd key in a template
would install and do nothing. The schemas are therefore made strict here: every object schema that lists
its properties, and neither preserves unknown fields nor says what other keys hold, refuses any other key.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import jsonschema
import yaml

CRD_DIR = Path(__file__).parent / "crds"
CRD_FILES = {
    ("keda.sh", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("inference.networking.k8s.io", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
}


def strict(schema: dict) -> dict:
    """A copy of an openAPIV3Schema in which unlisted keys fail, as a cluster would have pruned them."""
    schema = copy.deepcopy(schema)
    _close(schema)
    return schema


def _close(node) -> None:
    if isinstance(node, list):
        for item in node:
            _close(item)
        return
    if not isinstance(node, dict):
        return
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        node["additionalProperties"] = False
    for key, value in node.items():
        # Only schemas nest below these; `properties` maps names to schemas, and `enum`/`default` are data.
        if key == "properties":
            for child in value.values():
                _close(child)
        elif key in ("items", "additionalProperties", "allOf", "anyOf", "oneOf", "not"):
            _close(value)


def served_schema(api_version: str, kind: str) -> dict:
    """The openAPIV3Schema of `kind` at `api_version` (group/version), as the vendored CRD has it."""
    group, version = api_version.split("/")
    crd = yaml.safe_load((CRD_DIR / CRD_FILES[(group, kind)]).read_text())
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return served["schema"]["openAPIV3Schema"]


@cache
def crd_schema(api_version: str, kind: str) -> dict:
    """The strict schema of `kind` at `api_version`: unlisted keys fail."""
    return strict(served_schema(api_version, kind))


def validate_custom(obj: dict) -> None:
    """Raises jsonschema.ValidationError when `obj` does not fit its CRD's strict schema."""
    jsonschema.validate(obj, crd_schema(obj["apiVersion"], obj["kind"]))
