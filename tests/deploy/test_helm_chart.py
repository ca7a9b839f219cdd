"""The Helm chart in deploy/helm/pdserve, rendered by real Helm and checked object by object.

helm-python-sdk binds Helm's own Go library (libhelm_c, Helm v4), so lint, values-schema
validation and template rendering run in this process with no `helm` binary and no cluster.
Every rendered Kubernetes object is validated (strict: unknown fields fail) against the
Kubernetes 1.30 OpenAPI schemas shipped in kubernetes-validate. The RayCluster is KubeRay's
CRD, unknown to those schemas: each group's pod template is validated as a Pod, and the
KubeRay-specific parts (group names, replicas, rayStartParams, the command that starts
`pdserve serve`) are checked here, the command lines against pdserve's real CLI parser.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from pdserve import cli, cli_admin

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


@pytest.fixture(scope="module", params=list(VALUE_SETS))
def case(request, chart):
    """(user values, the chart's merged values, rendered objects) for one values set."""
    values = VALUE_SETS[request.param]
    return values, chart.merge_values(values), _render(chart, values)


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
    module = cli if hasattr(cli, f"_{command}") else cli_admin   # status, drain, scale
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


def test_every_rendered_object_validates(case):
    values, merged, objs = case
    assert Counter(o["kind"] for o in objs) == expected_kinds(merged)
    validate_all(objs)


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


# --- the RayCluster ------------------------------------------------------------------------

def test_worker_groups_follow_values(case):
    values, merged, objs = case
    ray = _one(objs, "RayCluster")
    groups = _groups(ray)
    assert list(groups) == ["prefill", "decode"]
    head = _container(ray["spec"]["headGroupSpec"]["template"])
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    for role, g in groups.items():
        want = merged[role]
        assert g["replicas"] == want["replicas"]
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["minReplicas"] == (want.get("minReplicas") or want["replicas"])
        params = g["rayStartParams"]
        # KubeRay pastes rayStartParams into `ray start --resources=<value>` and the shell
        # takes one layer of quoting off: what Ray gets must be the JSON object.
        ray_start = shlex.split(f"ray start --resources={params['resources']}")
        assert json.loads(ray_start[2].removeprefix("--resources=")) == {f"pdserve_{role}": 1}
        assert params["num-gpus"] == str(_gpus(want["resources"]))
        spec = g["template"]["spec"]
        res = _container(g["template"])["resources"]
        assert _gpus(res) == _gpus(want["resources"])
        rdma = merged["rdma"]
        for part in ("requests", "limits"):
            assert res[part].get(rdma["resourceName"]) == (rdma["count"] if rdma["enabled"]
                                                           else None)
        assert spec.get("nodeSelector", {}) == want["nodeSelector"]
        assert spec.get("tolerations", []) == want["tolerations"]
        assert g["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == role


def test_head_starts_ray_then_pdserve_serve(case, monkeypatch):
    values, merged, objs = case
    ray = _one(objs, "RayCluster")
    # Without this annotation KubeRay would replace the command and never run pdserve.
    assert ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = _container(ray["spec"]["headGroupSpec"]["template"])
    assert head["command"] == ["/bin/bash", "-lc", "--"]
    script = head["args"][0]
    subprocess.run(["bash", "-n", "-c", script], check=True)      # syntax only
    assert script.index('eval "$KUBERAY_GEN_RAY_START_CMD" &') < script.index("exec pdserve")
    for g in _groups(ray).values():    # the annotation is cluster-wide: workers run it too
        assert _container(g["template"])["args"] == [
            'ulimit -n 65536; eval "exec $KUBERAY_GEN_RAY_START_CMD"']

    serve = _cli_args(_serve_argv(ray), monkeypatch, "serve")
    groups = _groups(ray)
    assert serve["address"] == "auto" and serve["host"] == "0.0.0.0"
    assert serve["kv_host"] == "auto"
    assert serve["port"] == merged["grpc"]["port"]
    assert serve["metrics_port"] == merged["metrics"]["port"]
    assert serve["prefill_workers"] == groups["prefill"]["replicas"]
    assert serve["decode_workers"] == groups["decode"]["replicas"]
    assert serve["routers"] == merged["head"]["routers"] == 1
    # each worker asks Ray for exactly the custom resource its group's nodes declare
    assert serve["prefill_resources"] == {"pdserve_prefill": 1.0}
    assert serve["decode_resources"] == {"pdserve_decode": 1.0}
    assert serve["gpus_per_worker"] == float(groups["prefill"]["rayStartParams"]["num-gpus"])
    assert serve["transport"] == merged["transport"]
    assert serve["model"] == merged["model"]
    assert serve["threads_per_worker"] == merged["threadsPerWorker"]
    if merged["tls"]["enabled"]:
        assert (serve["tls_cert_file"], serve["tls_key_file"]) == (
            f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key")
    else:
        assert serve["tls_cert_file"] is None and serve["tls_key_file"] is None


def test_head_waits_for_every_worker_pod_before_serving(case, tmp_path):
    values, merged, objs = case
    script = _container(_one(objs, "RayCluster")["spec"]["headGroupSpec"]["template"])["args"][0]
    wait = re.search(r"until python -c '([^']*)' >/dev/null 2>&1; do sleep \d+; done", script)
    assert wait and script.index(wait.group(0)) < script.index("exec pdserve serve")
    # run the check against a stand-in `ray` module reporting the cluster's resources
    (tmp_path / "ray.py").write_text(
        "import json, os\n"
        "def init(**kw): pass\n"
        "def cluster_resources(): return json.loads(os.environ['RESOURCES'])\n")
    n, m = merged["prefill"]["replicas"], merged["decode"]["replicas"]

    def joined(prefill: int, decode: int) -> bool:
        env = {"PYTHONPATH": str(tmp_path), "RESOURCES": json.dumps(
            {"CPU": 8.0, "pdserve_prefill": float(prefill), "pdserve_decode": float(decode)})}
        return subprocess.run([sys.executable, "-c", wait.group(1)], env=env).returncode == 0

    assert joined(n, m) and joined(n + 1, m)
    assert not joined(n - 1, m) and not joined(n, m - 1) and not joined(0, 0)


def test_ports_and_services(case):
    values, merged, objs = case
    ray = _one(objs, "RayCluster")
    head_template = ray["spec"]["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in _container(head_template)["ports"]}
    want = {"gcs-server": 6379, "dashboard": 8265, "client": 10001,
            "grpc": merged["grpc"]["port"], "pdserve-metrics": merged["metrics"]["port"]}
    if merged["http"]["enabled"]:
        want["http"] = merged["http"]["port"]
    assert ports == want
    assert (merged["grpc"]["port"], merged["metrics"]["port"]) == (50051, 9464)

    worker_labels = [g["template"]["metadata"]["labels"] for g in _groups(ray).values()]
    for svc_name, port_names in ((RELEASE, {"grpc"} | ({"http"} if merged["http"]["enabled"]
                                                      else set())),
                                 (f"{RELEASE}-metrics", {"metrics"})):
        svc = _one(objs, "Service", svc_name)
        selector = svc["spec"]["selector"].items()
        # the router runs on the head: select the head pod, never a worker
        assert selector <= head_template["metadata"]["labels"].items()
        assert not any(selector <= labels.items() for labels in worker_labels)
        assert {p["name"] for p in svc["spec"]["ports"]} == port_names
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports and p["port"] == ports[p["targetPort"]]
    assert _one(objs, "Service", RELEASE)["spec"]["type"] == merged["service"]["type"]


def test_router_replicas_share_the_ports_and_each_is_scraped(chart, monkeypatch):
    objs = _render(chart, {"head": {"routers": 3}, "http": {"enabled": True},
                           "metrics": {"serviceMonitor": {"enabled": True}}})
    ray = _one(objs, "RayCluster")
    assert _cli_args(_serve_argv(ray), monkeypatch, "serve")["routers"] == 3
    ports = {p["name"]: p["containerPort"]
             for p in _container(ray["spec"]["headGroupSpec"]["template"])["ports"]}
    assert (ports["pdserve-metrics"], ports["rtr-metrics-1"], ports["rtr-metrics-2"]) == (
        9464, 9465, 9466)
    svc = _one(objs, "Service", f"{RELEASE}-metrics")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "metrics": (9464, "pdserve-metrics"), "metrics-1": (9465, "rtr-metrics-1"),
        "metrics-2": (9466, "rtr-metrics-2")}
    monitor = _one(objs, "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics", "metrics-1",
                                                                 "metrics-2"]
    client = _one(objs, "Service", RELEASE)        # one gRPC and one HTTP port for all
    assert {p["name"] for p in client["spec"]["ports"]} == {"grpc", "http"}


def test_http_port_is_a_toggle(chart, monkeypatch):
    objs = _render(chart, {"http": {"enabled": True}})
    ray = _one(objs, "RayCluster")
    assert _cli_args(_serve_argv(ray), monkeypatch, "serve")["http_port"] == 8000
    assert _cli_args(_serve_argv(_one(_render(chart, {}), "RayCluster")), monkeypatch,
                     "serve")["http_port"] is None
    head = _container(ray["spec"]["headGroupSpec"]["template"])
    assert {"name": "http", "containerPort": 8000} in head["ports"]
    svc_ports = _one(objs, "Service", RELEASE)["spec"]["ports"]
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"} in svc_ports


@pytest.mark.parametrize("values, readiness", [
    ({}, "grpc"),
    ({"http": {"enabled": True}}, "http"),
    ({"http": {"enabled": True}, "tls": {"enabled": True, "existingSecret": "s"}}, "https"),
    ({"http": {"enabled": True}, "tls": {"enabled": True, "existingSecret": "s",
                                         "clientAuth": True}}, "tcp"),
], ids=["grpc", "http", "https", "mtls"])
def test_head_probes_the_router(chart, values, readiness):
    objs = _render(chart, values)
    merged = chart.merge_values(values)
    head = _container(_one(objs, "RayCluster")["spec"]["headGroupSpec"]["template"])
    grpc_probe = ({"tcpSocket": {"port": "grpc"}} if merged["tls"]["enabled"]
                  else {"grpc": {"port": merged["grpc"]["port"]}})
    probes = merged["head"]["probes"]
    for name, timeout_s in (("startupProbe", probes["startupTimeoutSeconds"]),
                            ("livenessProbe", probes["livenessTimeoutSeconds"])):
        p = head[name]
        assert {k: p[k] for k in grpc_probe} == grpc_probe
        assert p["periodSeconds"] * p["failureThreshold"] >= timeout_s
        assert p["periodSeconds"] * (p["failureThreshold"] - 1) < timeout_s
    r = head["readinessProbe"]
    if readiness in ("http", "https"):
        assert r["httpGet"] == {"path": "/health", "port": "http", "scheme": readiness.upper()}
    else:
        assert {k: r[k] for k in grpc_probe} == grpc_probe
    validate_all(objs)


def test_worker_prestop_drains_then_stops_ray(case, monkeypatch):
    values, merged, objs = case
    timeout_s = merged["drainTimeoutSeconds"]
    for g in _groups(_one(objs, "RayCluster")).values():
        drain, after = _prestop(g)
        assert after == "ray stop"
        assert drain[:2] == ["pdserve", "drain"]
        args = _cli_args(drain[1:], monkeypatch, "drain")
        # the Service in front of the router, by the name a TLS certificate must carry
        assert args["server"] == f"{RELEASE}.{NAMESPACE}.svc:{merged['grpc']['port']}"
        assert _one(objs, "Service", RELEASE)
        assert args["node_ip"] == "$POD_IP"             # the shell expands it in the hook
        assert args["timeout_s"] == timeout_s
        pod_ip = [e for e in _container(g["template"])["env"] if e["name"] == "POD_IP"]
        assert pod_ip == [{"name": "POD_IP",
                           "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        assert g["template"]["spec"]["terminationGracePeriodSeconds"] > timeout_s
        assert args["tls_ca"] == (f"{TLS_DIR}/ca.crt" if merged["tls"]["enabled"] else None)


def pod_templates(ray: dict) -> dict[str, dict]:
    """The pod template of the head and of each worker group, by role."""
    return {"head": ray["spec"]["headGroupSpec"]["template"],
            **{role: g["template"] for role, g in _groups(ray).items()}}


def tls_files(template: dict) -> set[str] | None:
    """The files of the TLS Secret a pod mounts at TLS_DIR (None: not mounted)."""
    mounts = {m["mountPath"]: m for m in _container(template).get("volumeMounts", [])}
    if TLS_DIR not in mounts:
        return None
    assert mounts[TLS_DIR]["readOnly"] is True
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mounts[TLS_DIR]["name"]]
    items = volume["secret"].get("items")
    return ({i["path"] for i in items} if items is not None
            else {"tls.crt", "tls.key", "ca.crt"})      # a kubernetes.io/tls Secret's keys


def test_tls_secret_and_api_key_wiring(case):
    """The api key and the TLS key reach the head (the router) only; a worker's drain
    hook gets the CA to check the router, and its own certificate with clientAuth."""
    values, merged, objs = case
    for role, t in pod_templates(_one(objs, "RayCluster")).items():
        env = {e["name"]: e for e in _container(t)["env"]}
        if merged["apiKey"]["existingSecret"] and role == "head":
            assert env["PDSERVE_API_KEY"]["valueFrom"] == {"secretKeyRef": {
                "name": merged["apiKey"]["existingSecret"], "key": merged["apiKey"]["key"]}}
        else:
            assert "PDSERVE_API_KEY" not in env
        files = tls_files(t)
        if not merged["tls"]["enabled"]:
            assert files is None
        elif role == "head" or merged["tls"]["clientAuth"]:
            assert files == {"tls.crt", "tls.key", "ca.crt"}
        else:
            assert files == {"ca.crt"}
        if merged["tls"]["enabled"]:
            (volume,) = [v for v in t["spec"]["volumes"] if v["name"] == "pdserve-tls"]
            assert volume["secret"]["secretName"] == merged["tls"]["existingSecret"]
        # the key only ever travels as a secretKeyRef, never as a literal
        assert "value" not in env.get("PDSERVE_API_KEY", {})


def test_mutual_tls_passes_client_certificates(chart, monkeypatch):
    objs = _render(chart, {"tls": {"enabled": True, "existingSecret": "s", "clientAuth": True}})
    ray = _one(objs, "RayCluster")
    serve = _cli_args(_serve_argv(ray), monkeypatch, "serve")
    assert serve["tls_client_ca_file"] == f"{TLS_DIR}/ca.crt"
    for role, g in _groups(ray).items():
        drain = _cli_args(_prestop(g)[0][1:], monkeypatch, "drain")
        assert (drain["tls_cert"], drain["tls_key"]) == (f"{TLS_DIR}/tls.crt",
                                                         f"{TLS_DIR}/tls.key")
        # the files it names are in the pod
        assert tls_files(g["template"]) == {"tls.crt", "tls.key", "ca.crt"}
    validate_all(objs)


def test_gpu_rdma_values_file_turns_everything_on():
    v = VALUE_SETS["gpu-rdma"]
    assert v["transport"] == "nixl" and v["rdma"]["enabled"]
    assert v["tls"]["enabled"] and v["apiKey"]["existingSecret"]
    assert v["metrics"]["serviceMonitor"]["enabled"]
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
