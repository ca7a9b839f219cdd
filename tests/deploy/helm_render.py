"""The Helm chart rendered by Helm's own library, and the helpers that take its objects apart."""

from __future__ import annotations

import shlex
from pathlib import Path

import kubernetes_validate
import yaml

from pdserve import cli, cli_admin, serve

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
GPU_VALUES_FILE = CHART / "values-gpu-rdma.yaml"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "pdserve", "serving"
TLS_DIR = "/etc/pdserve/tls"

# Fields of KubeRay's ray.io/v1 RayCluster this chart may set (a typo would be dropped
# silently by the API server's pruning, so it fails here instead).
RAYCLUSTER_SPEC_FIELDS = {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions",
                          "headGroupSpec", "workerGroupSpecs"}
HEAD_GROUP_FIELDS = {"rayStartParams", "template", "serviceType"}
WORKER_GROUP_FIELDS = {"groupName", "replicas", "minReplicas", "maxReplicas",
                       "rayStartParams", "template"}


def _gpu_values() -> dict:
    return yaml.safe_load(GPU_VALUES_FILE.read_text())


VALUE_SETS = {"default": {}, "gpu-rdma": _gpu_values()}


def _render(chart, values: dict | None = None) -> list[dict]:
    manifests = chart.render(values or None, name=RELEASE, namespace=NAMESPACE)
    objs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objs += [o for o in yaml.safe_load_all(text) if o]
    return objs


def _one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"want one {kind} {name or ''}, got {len(found)}"
    return found[0]


def _groups(ray: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}


def _container(template: dict) -> dict:
    return template["spec"]["containers"][0]     # KubeRay's Ray container is the first


def _cli_args(argv: list[str], monkeypatch, command: str) -> dict:
    """Parse argv with pdserve's own CLI parser; returns the parsed namespace as a dict."""
    seen = {}
    module = next(m for m in (serve, cli, cli_admin) if hasattr(m, f"_{command}"))
    monkeypatch.setattr(module, f"_{command}", lambda a: seen.update(vars(a)) or 0)
    assert cli.main(argv) == 0
    return seen


def _serve_argv(ray: dict) -> list[str]:
    script = _container(ray["spec"]["headGroupSpec"]["template"])["args"][0]
    line = script[script.index("exec pdserve serve"):].replace("\\\n", " ")
    argv = shlex.split(line)
    assert argv[:3] == ["exec", "pdserve", "serve"]
    return argv[2:]                       # what pdserve's main() gets: ["serve", ...]


def _prestop(group: dict) -> tuple[list[str], str]:
    """The drain argv (shell-split) and what runs after it."""
    command = _container(group["template"])["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/bash", "-lc"]
    drain, after = command[2].split(";")
    return shlex.split(drain), after.strip()


def _gpus(resources: dict) -> int:
    return int(resources.get("limits", {}).get("nvidia.com/gpu", 0))


def pod_templates(ray: dict) -> dict[str, dict]:
    """The pod template of the head and of each worker group, by role."""
    return {"head": ray["spec"]["headGroupSpec"]["template"],
            **{role: g["template"] for role, g in _groups(ray).items()}}


def validate_all(objs: list[dict]) -> None:
    """Every object against the Kubernetes schemas (KubeRay's and the Prometheus
    Operator's kinds by the checks below)."""
    for obj in objs:
        if obj["kind"] == "RayCluster":
            _validate_raycluster(obj)
        elif obj["kind"] == "ServiceMonitor":
            _validate_service_monitor(obj, objs)
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def _validate_raycluster(ray: dict) -> None:
    assert ray["apiVersion"] == "ray.io/v1"
    spec = ray["spec"]
    assert set(spec) <= RAYCLUSTER_SPEC_FIELDS
    assert set(spec["headGroupSpec"]) <= HEAD_GROUP_FIELDS
    templates = {"head": spec["headGroupSpec"]["template"]}
    for g in spec["workerGroupSpecs"]:
        assert set(g) <= WORKER_GROUP_FIELDS
        templates[g["groupName"]] = g["template"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        # KubeRay's CRD types rayStartParams as map[string]string
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    for name, template in templates.items():
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**template.get("metadata", {}), "name": f"{RELEASE}-{name}"},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)


def _validate_service_monitor(sm: dict, objs: list[dict]) -> None:
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) <= {"selector", "namespaceSelector", "endpoints"}
    selected = [o for o in objs if o["kind"] == "Service" and
                sm["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == [f"{RELEASE}-metrics"]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in port_names and ep["path"] == "/metrics"
