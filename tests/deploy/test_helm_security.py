"""The Helm chart's restrictions, on by default and relaxed only by values: the admin key
(a generated Secret, in the head and in the workers' drain hook), Ray's token auth, the
api key and TLS key in the head pod only, Kubernetes' "restricted" Pod Security Standard
on every pod and container with a read-only root filesystem, NetworkPolicies (checked
by evaluating them for sample sources and ports), a PodDisruptionBudget per worker
group, and the schema's refusal of an open LoadBalancer."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
from helm_render import (KUBE_VERSION, NAMESPACE, RELEASE, VALUE_SETS, _container, _groups,
                         _one, _prestop, _render, pod_templates, validate_all)

DOCKERFILE = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "Dockerfile"
TLS = {"tls": {"enabled": True, "existingSecret": "pdserve-tls"}}
ADMIN_SECRET, RAY_SECRET = f"{RELEASE}-admin-api-key", f"{RELEASE}-ray-auth-token"
# Pod Security Standards, "restricted" (Kubernetes 1.30): what a pod may carry.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _secret_ref(env: dict, name: str) -> dict | None:
    return env[name]["valueFrom"]["secretKeyRef"] if name in env else None


def _secret_value(objs: list[dict], name: str, key: str) -> str:
    return base64.b64decode(_one(objs, "Secret", name)["data"][key]).decode()


# --- the admin key and Ray's token -------------------------------------------------------

def test_admin_key_is_generated_for_the_head_and_the_drain_hook(chart):
    objs = _render(chart)
    key = _secret_value(objs, ADMIN_SECRET, "admin-api-key")
    assert re.fullmatch(r"[A-Za-z0-9]{48}", key)
    assert key != _secret_value(_render(chart), ADMIN_SECRET, "admin-api-key")   # random
    ray = _one(objs, "RayCluster")
    for role, t in pod_templates(ray).items():
        assert _secret_ref(_env(_container(t)), "PDSERVE_ADMIN_API_KEY") == {
            "name": ADMIN_SECRET, "key": "admin-api-key"}, role
    for g in _groups(ray).values():
        drain, _ = _prestop(g)
        # the hook runs in the container's environment: pdserve drain reads the key there
        assert not any(w.startswith(("--admin-api-key", "--api-key")) for w in drain)


@pytest.mark.parametrize("admin, secret", [
    ({"existingSecret": "mine", "key": "k"}, {"name": "mine", "key": "k"}),
    ({"create": False}, None),
], ids=["existing", "none"])
def test_admin_key_from_a_secret_of_yours_or_none(chart, admin, secret):
    objs = _render(chart, {"adminApiKey": admin})
    assert not [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == ADMIN_SECRET]
    for t in pod_templates(_one(objs, "RayCluster")).values():
        assert _secret_ref(_env(_container(t)), "PDSERVE_ADMIN_API_KEY") == secret


def test_admin_key_equal_to_the_api_key_is_refused(chart):
    with pytest.raises(helm.HelmError, match="adminApiKey"):
        _render(chart, {"apiKey": {"existingSecret": "keys", "key": "k"},
                        "adminApiKey": {"existingSecret": "keys", "key": "k"}})


def test_ray_token_auth_is_on_in_every_ray_container(chart):
    objs = _render(chart, {"planner": {"enabled": True}, "decode": {"maxReplicas": 3}})
    assert re.fullmatch(r"[A-Za-z0-9]{64}", _secret_value(objs, RAY_SECRET, "token"))
    ray = _one(objs, "RayCluster")
    autoscaler = ray["spec"]["autoscalerOptions"]
    for env in [_env(autoscaler), *(_env(_container(t)) for t in pod_templates(ray).values())]:
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert _secret_ref(env, "RAY_AUTH_TOKEN") == {"name": RAY_SECRET, "key": "token"}
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_without_ray_token_auth_the_dashboard_stays_on_loopback(chart):
    objs = _render(chart, {"rayAuth": {"enabled": False}})
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Secret"] == [ADMIN_SECRET]
    ray = _one(objs, "RayCluster")
    assert ray["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for t in pod_templates(ray).values():
        assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(_env(_container(t)))
    mine = _render(chart, {"rayAuth": {"existingSecret": "ray-token", "key": "t"}})
    assert RAY_SECRET not in {o["metadata"]["name"] for o in mine if o["kind"] == "Secret"}
    head = _container(_one(mine, "RayCluster")["spec"]["headGroupSpec"]["template"])
    assert _secret_ref(_env(head), "RAY_AUTH_TOKEN") == {"name": "ray-token", "key": "t"}


# --- pod security --------------------------------------------------------------------------

def _restricted_violations(spec: dict, containers: list[dict]) -> list[str]:
    """What breaks Pod Security Standards' "restricted" profile (the checks a chart can
    get wrong: no host namespaces, ports or paths; non-root; seccomp; no escalation;
    every capability dropped but NET_BIND_SERVICE)."""
    bad = [f"host {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    bad += [f"volume {v['name']}" for v in spec.get("volumes", [])
            if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    pod = spec.get("securityContext", {})
    for c in containers:
        sc = c.get("securityContext", {})

        def get(key):
            return sc.get(key, pod.get(key))

        name = c.get("name", "autoscaler")
        if get("runAsNonRoot") is not True or get("runAsUser") == 0:
            bad.append(f"{name}: may run as root")
        if (get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: no seccomp profile")
        if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
            bad.append(f"{name}: privilege escalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities {caps}")
        if any("hostPort" in p for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
    return bad


def test_every_pod_and_container_is_restricted_with_a_read_only_root(chart):
    objs = _render(chart, {"planner": {"enabled": True}, "decode": {"maxReplicas": 3}})
    ray = _one(objs, "RayCluster")
    (uid,) = re.findall(r"useradd .*--uid (\d+)", DOCKERFILE.read_text())
    (home,) = re.findall(r"^\s+HOME=(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    for role, t in pod_templates(ray).items():
        spec = t["spec"]
        assert _restricted_violations(spec, spec["containers"]) == [], role
        c = _container(t)
        assert spec["securityContext"]["runAsUser"] == c["securityContext"]["runAsUser"] == int(uid)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # what Ray and pdserve write: /tmp (/tmp/ray) and the home's caches, on emptyDirs
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        for path in ("/tmp", f"{home}/.cache"):
            assert mounts[path]["emptyDir"] == {}, (role, path)
        env = _env(c)
        for var in ("TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):
            assert env[var]["value"].startswith(f"{home}/.cache/")
    # KubeRay's autoscaler container, in the head pod, is held to the same rules
    autoscaler = ray["spec"]["autoscalerOptions"]
    head_spec = ray["spec"]["headGroupSpec"]["template"]["spec"]
    assert _restricted_violations(head_spec, [autoscaler]) == []
    assert {m["mountPath"] for m in autoscaler["volumeMounts"]} == {"/tmp", f"{home}/.cache"}
    validate_all(objs)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "autoscaler"},
           "spec": {**head_spec, "containers": [{"name": "autoscaler", "image": "ray",
                                                  **autoscaler_container(autoscaler)}]}}
    kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)


def autoscaler_container(options: dict) -> dict:
    """The Container fields of KubeRay's autoscalerOptions that the chart sets."""
    return {k: options[k] for k in ("env", "securityContext", "volumeMounts")}


def test_gpu_rdma_values_add_ipc_lock_to_the_restricted_context(chart):
    for g in _groups(_one(_render(chart, VALUE_SETS["gpu-rdma"]), "RayCluster")).values():
        caps = _container(g["template"])["securityContext"]["capabilities"]
        assert caps == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_security_contexts_relax_by_values(chart):
    objs = _render(chart, {"securityContext": {"readOnlyRootFilesystem": False,
                                               "capabilities": None},
                           "podSecurityContext": {"seccompProfile": None}})
    for t in pod_templates(_one(objs, "RayCluster")).values():
        sc = _container(t)["securityContext"]
        assert sc["readOnlyRootFilesystem"] is False and "capabilities" not in sc
        assert "seccompProfile" not in t["spec"]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False      # the rest stays


# --- NetworkPolicies -----------------------------------------------------------------------

def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector      # what the chart writes
    return selector.get("matchLabels", {}).items() <= labels.items()


# Namespaces' labels beyond the one Kubernetes sets on each (kubernetes.io/metadata.name)
NAMESPACE_LABELS = {"apps": {"team": "apps"}}


def _peer_admits(peer: dict, src: dict, src_ns: str) -> bool:
    if "ipBlock" in peer:            # addresses outside the cluster: no pod here
        return False
    ns_labels = {"kubernetes.io/metadata.name": src_ns, **NAMESPACE_LABELS.get(src_ns, {})}
    in_ns = (_selects(peer["namespaceSelector"], ns_labels)
             if "namespaceSelector" in peer else src_ns == NAMESPACE)
    return in_ns and _selects(peer.get("podSelector", {}), src)


def admits(objs: list[dict], dst: dict, port: int, src: dict, src_ns: str = NAMESPACE) -> bool:
    """Whether the rendered NetworkPolicies let a pod labelled `src` in namespace
    `src_ns` connect to TCP `port` of a release pod labelled `dst` (Kubernetes'
    semantics: a pod no policy selects admits all; else the union of the rules)."""
    policies = [o["spec"] for o in objs if o["kind"] == "NetworkPolicy"
                and _selects(o["spec"]["podSelector"], dst) and "Ingress" in o["spec"]["policyTypes"]]
    return not policies or any(
        ("ports" not in rule or any(p["port"] == port for p in rule["ports"]))
        and ("from" not in rule or any(_peer_admits(peer, src, src_ns) for peer in rule["from"]))
        for spec in policies for rule in spec.get("ingress", []))


RAY_PORTS = (6379, 8265, 10001, 8076, 23456)    # GCS, dashboard, client, objects, a worker's
CLIENT, PROMETHEUS = {"app": "client"}, {"app.kubernetes.io/name": "prometheus"}


def _labels(objs: list[dict]) -> dict[str, dict]:
    return {role: t["metadata"]["labels"]
            for role, t in pod_templates(_one(objs, "RayCluster")).items()}


def test_network_policies_admit_the_release_and_the_routers_clients_only(chart):
    objs = _render(chart, {"http": {"enabled": True}, "head": {"routers": 2}})
    pods = _labels(objs)
    for dst in pods.values():
        for src in pods.values():
            assert all(admits(objs, dst, port, src) for port in (*RAY_PORTS, 50051, 9464))
    head = pods["head"]
    assert admits(objs, head, 50051, CLIENT) and admits(objs, head, 8000, CLIENT)
    assert not admits(objs, head, 50051, CLIENT, "other")          # the namespace only
    for port in (*RAY_PORTS, 9464, 9465, 8080):
        assert not admits(objs, head, port, CLIENT)
    for role in ("prefill", "decode"):
        assert not any(admits(objs, pods[role], port, CLIENT) for port in (*RAY_PORTS, 50051))
    # Prometheus (kube-prometheus-stack's labels, any namespace): the metrics ports only
    for port in (9464, 9465, 8080):
        assert admits(objs, head, port, PROMETHEUS, "monitoring")
    assert admits(objs, pods["decode"], 8080, PROMETHEUS, "monitoring")
    assert not any(admits(objs, head, port, PROMETHEUS, "monitoring")
                   for port in (*RAY_PORTS, 50051, 8000))
    validate_all(objs)


def test_network_policies_follow_values(chart):
    objs = _render(chart, {"networkPolicy": {
        "routerFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        "metricsFrom": []}})
    head = _labels(objs)["head"]
    assert admits(objs, head, 50051, CLIENT, "apps") and admits(objs, head, 50051, CLIENT)
    assert not admits(objs, head, 50051, CLIENT, "other")
    assert not admits(objs, head, 6379, CLIENT, "apps")           # the router's ports only
    assert not admits(objs, head, 9464, PROMETHEUS, "monitoring")   # metricsFrom: []
    off = _render(chart, {"networkPolicy": {"enabled": False}})
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]
    assert all(admits(off, head, port, CLIENT, "other") for port in RAY_PORTS)


def test_a_public_service_needs_its_clients_in_the_policy(chart):
    lb = {**TLS, "service": {"type": "LoadBalancer"}}
    with pytest.raises(helm.HelmError, match="networkPolicy.routerFrom"):
        _render(chart, lb)
    objs = _render(chart, {**lb, "networkPolicy": {
        "routerFrom": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}})
    assert _one(objs, "Service", RELEASE)["spec"]["type"] == "LoadBalancer"
    validate_all(objs)
    assert _render(chart, {**lb, "networkPolicy": {"enabled": False}})


# --- PodDisruptionBudgets -----------------------------------------------------------------

@pytest.mark.parametrize("values, want", [
    ({}, {"prefill": 0, "decode": 0}),
    ({"prefill": {"replicas": 3}, "decode": {"replicas": 4},
      "podDisruptionBudget": {"maxUnavailable": 2}}, {"prefill": 1, "decode": 2}),
    ({"planner": {"enabled": True}, "decode": {"replicas": 3, "minReplicas": 2,
                                              "maxReplicas": 6}}, {"prefill": 0, "decode": 1}),
], ids=["default", "replicas", "planner"])
def test_a_disruption_budget_per_worker_group(chart, values, want):
    objs = _render(chart, values)
    pods = _labels(objs)
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    assert len(pdbs) == 2
    for pdb in pdbs:
        selected = [r for r, labels in pods.items()
                    if _selects(pdb["spec"]["selector"], labels)]
        (role,) = selected                       # one worker group, never the head
        # RayCluster has no scale subresource: an integer minAvailable, no maxUnavailable
        assert set(pdb["spec"]) == {"minAvailable", "selector"}
        assert pdb["spec"]["minAvailable"] == want[role]
        kubernetes_validate.validate(pdb, KUBE_VERSION, strict=True)
    assert not [o for o in _render(chart, {"podDisruptionBudget": {"enabled": False}})
                if o["kind"] == "PodDisruptionBudget"]


# --- the schema ----------------------------------------------------------------------------

@pytest.mark.parametrize("values", [
    {"service": {"type": "LoadBalancer"}},
    {"service": {"type": "LoadBalancer"}, "tls": {"enabled": False}, "apiKey": {"key": "k"}},
    {"networkPolicy": {"enabled": "yes"}},
    {"networkPolicy": {"routerFrom": [{}]}},
    {"networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": {"a": 1}}}]}},
    {"networkPolicy": {"egress": []}},
    {"podDisruptionBudget": {"maxUnavailable": -1}},
    {"podDisruptionBudget": {"maxUnavailable": "50%"}},
    {"adminApiKey": {"create": "true"}},
    {"rayAuth": {"key": ""}},
], ids=lambda v: str(v))
def test_schema_refuses(chart, values):
    with pytest.raises(helm.HelmValuesError, match="schema"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("values", [
    {**TLS, "service": {"type": "LoadBalancer"}},
    {"apiKey": {"existingSecret": "keys"}, "service": {"type": "LoadBalancer"}},
], ids=["tls", "api-key"])
def test_a_load_balancer_with_tls_or_an_api_key_is_accepted(chart, values):
    values = {**values, "networkPolicy": {"routerFrom": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}}
    validate_all(_render(chart, values))
