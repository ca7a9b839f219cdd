"""The Helm chart's SLO planner (planner.enabled): `serve --planner slo` within each
worker group's minReplicas / maxReplicas, and KubeRay's autoscaler on within the same
bounds (docs/deployment.md, "Run on Kubernetes"; docs/planner.md)."""

import helm_python as helm
import pytest
from helm_render import NAMESPACE, RELEASE, _cli_args, _groups, _one, _render, _serve_argv

# KubeRay's ray.io/v1 RayCluster spec.autoscalerOptions fields this chart may set
AUTOSCALER_OPTIONS_FIELDS = {"idleTimeoutSeconds", "upscalingMode", "env", "securityContext",
                             "volumeMounts"}


def test_planner_turns_on_kuberays_autoscaler_with_the_same_bounds(chart, monkeypatch):
    """planner.enabled: serve runs the SLO planner within each group's min/maxReplicas,
    and KubeRay's autoscaler adds and removes worker pods within the same bounds."""
    objs = _render(chart, {"planner": {"enabled": True, "sloTtftMs": 1500, "sloItlMs": 80,
                                       "maxWorkers": 5},
                           "prefill": {"minReplicas": 1, "maxReplicas": 3},
                           "decode": {"replicas": 2, "maxReplicas": 4}})
    ray = _one(objs, "RayCluster")
    assert ray["spec"]["enableInTreeAutoscaling"] is True
    assert set(ray["spec"]["autoscalerOptions"]) <= AUTOSCALER_OPTIONS_FIELDS
    assert ray["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    serve = _cli_args(_serve_argv(ray), monkeypatch, "serve")
    assert (serve["planner"], serve["slo_ttft_ms"], serve["slo_itl_ms"]) == ("slo", 1500, 80)
    groups = _groups(ray)
    for role in ("prefill", "decode"):
        assert (serve[f"min_{role}_workers"], serve[f"max_{role}_workers"]) == (
            groups[role]["minReplicas"], groups[role]["maxReplicas"])
    assert (serve["min_decode_workers"], serve["max_decode_workers"]) == (2, 4)
    assert serve["max_workers"] == 5 and serve["decode_workers"] == 2
    off = _one(_render(chart, {}), "RayCluster")
    assert off["spec"]["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in off["spec"]
    assert _cli_args(_serve_argv(off), monkeypatch, "serve")["planner"] == "none"


@pytest.mark.parametrize("values, message", [
    ({"planner": {"enabled": True}, "decode": {"minReplicas": 0}}, "decode.minReplicas"),
    ({"planner": {"enabled": True, "maxWorkers": 2}, "decode": {"replicas": 2,
                                                                 "maxReplicas": 2}},
     "planner.maxWorkers"),
])
def test_template_rejects_planner_values_serve_would_refuse(chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_schema_rejects_a_non_positive_target(chart):
    with pytest.raises(helm.HelmValuesError, match="schema"):
        chart.render({"planner": {"enabled": True, "sloTtftMs": 0}}, name=RELEASE,
                     namespace=NAMESPACE)
