"""What the release says about itself: its labels and the NOTES Helm prints after install.

Kept beside test_chart.py, whose helpers it uses, so that each file stays within 400 lines.
"""

from __future__ import annotations

from tests.helm.test_chart import FULLNAME, NAMESPACE, RELEASE, chart, one, render, render_raw  # noqa: F401 (chart is a fixture)


def test_labels(chart):
    deployment = one(render(chart, {}), "Deployment")
    labels = deployment["metadata"]["labels"]
    assert labels == {
        "helm.sh/chart": "embedserv-0.1.0",
        "app.kubernetes.io/name": "embedserv",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/version": "0.1.0",
        "app.kubernetes.io/managed-by": "Helm",
    }
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "embedserv",
        "app.kubernetes.io/instance": RELEASE,
    }


def test_notes(chart):
    notes = render_raw(chart, {})["embedserv/templates/NOTES.txt"]
    assert f"dns:///{FULLNAME}-headless.{NAMESPACE}.svc.cluster.local:50051" in notes
    assert f"port-forward svc/{FULLNAME} 50051:50051" in notes
    assert 'embedserv-client --target 127.0.0.1:50051 embed "hello"' in notes
    assert f"helm test {RELEASE}" in notes
    assert f"port-forward svc/{FULLNAME} 8000:8000" in notes and 'base_url="http://127.0.0.1:8000/v1"' in notes
    assert "8000" not in render_raw(chart, {"service": {"httpPort": 0}})["embedserv/templates/NOTES.txt"]
