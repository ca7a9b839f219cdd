"""The Helm chart in deploy/helm/pdserve, rendered by real Helm: lint, every object
validated, and the values the chart refuses.

helm-python-sdk binds Helm's own Go library (libhelm_c, Helm v4), so lint, values-schema
validation and template rendering run in this process with no `helm` binary and no cluster.
Every rendered Kubernetes object is validated (strict: unknown fields fail) against the
Kubernetes 1.30 OpenAPI schemas shipped in kubernetes-validate. The RayCluster is KubeRay's
CRD, unknown to those schemas: each group's pod template is validated as a Pod, and the
fields this chart may set are checked (tests/deploy/helm_render.py); its KubeRay-specific
parts (group names, replicas, rayStartParams, the command that starts `pdserve serve`)
are checked in test_helm_raycluster.py, the command lines against pdserve's real CLI parser.
"""

from __future__ import annotations

import json
from collections import Counter

import helm_python as helm
import pytest

from helm_render import (CHART, KUBE_VERSION, NAMESPACE, RELEASE, VALUE_SETS, _gpus,
                         validate_all)


# --- lint and validation ---------------------------------------------------------------

@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_passes(name):
    report = helm.lint(CHART, VALUE_SETS[name] or None, strict=True,
                       kube_version=f"v{KUBE_VERSION}", namespace=NAMESPACE)
    assert report["errors"] == []
    # severity 1 is info ("icon is recommended"); warnings would fail `helm lint --strict`
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def expected_kinds(merged: dict) -> Counter:
    """How many objects of each kind the chart renders with these (merged) values."""
    generated_secrets = (
        (merged["adminApiKey"]["create"] and not merged["adminApiKey"]["existingSecret"])
        + (merged["rayAuth"]["enabled"] and not merged["rayAuth"]["existingSecret"]))
    return +Counter({"RayCluster": 1, "Service": 2,
                     "ServiceMonitor": int(merged["metrics"]["serviceMonitor"]["enabled"]),
                     "Secret": generated_secrets,
                     "NetworkPolicy": 2 * merged["networkPolicy"]["enabled"],
                     "PodDisruptionBudget": 2 * merged["podDisruptionBudget"]["enabled"]})


def test_every_rendered_object_validates(case):
    values, merged, objs = case
    assert Counter(o["kind"] for o in objs) == expected_kinds(merged)
    validate_all(objs)


def test_gpu_rdma_values_file_turns_everything_on():
    v = VALUE_SETS["gpu-rdma"]
    assert v["transport"] == "nixl" and v["rdma"]["enabled"]
    assert v["tls"]["enabled"] and v["apiKey"]["existingSecret"]
    assert v["metrics"]["serviceMonitor"]["enabled"]
    assert v["tracing"]["otlpEndpoint"] and 0 < v["tracing"]["sampleRatio"] < 1
    for role in ("prefill", "decode"):
        assert _gpus(v[role]["resources"]) >= 1
        assert v[role]["nodeSelector"] and v[role]["tolerations"]


# --- what the chart refuses --------------------------------------------------------------

@pytest.mark.parametrize("values", [
    {"prefill": {"replicas": -1}},
    {"decode": {"replicas": 0}},
    {"replicaCount": 3},                                   # unknown top-level key
    {"prefill": {"gpus": 1}},                              # unknown group key
    {"transport": "rdma"},
    {"tls": {"enabled": True}},                            # TLS without its Secret
    {"grpc": {"port": 70000}},
    {"prefill": {"resources": {"limits": {"cpu": "four"}}}},
    {"drainTimeoutSeconds": "2m"},
    {"rdma": {"enabled": True, "resourceName": "no-slash"}},
    {"tracing": {"otlpEndpoint": "c:4317", "sampleRatio": 2}},
], ids=lambda v: json.dumps(v))
def test_schema_rejects_bad_values(chart, values):
    with pytest.raises(helm.HelmValuesError, match="schema"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("values, message", [
    ({"prefill": {"resources": {"limits": {"nvidia.com/gpu": 2}}},
      "decode": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "--gpus-per-worker"),
    ({"decode": {"replicas": 2, "minReplicas": 3}}, "minReplicas"),
    ({"prefill": {"replicas": 4, "maxReplicas": 2}}, "maxReplicas"),
])
def test_template_rejects_inconsistent_values(chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
