"""The chart's RayCluster: worker groups as the values say, the head starting Ray, waiting
for every worker pod, then `pdserve serve` (its command line parsed by pdserve's own
CLI), and each worker's preStop hook draining it before Ray stops."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

from helm_render import (NAMESPACE, RELEASE, TLS_DIR, _cli_args, _container, _gpus, _groups,
                         _one, _prestop, _serve_argv)


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
    tracing = merged["tracing"]
    assert serve["otlp_traces_endpoint"] == (tracing["otlpEndpoint"] or None)
    assert serve["otlp_traces_sample_ratio"] == (
        tracing["sampleRatio"] if tracing["otlpEndpoint"] else None)
    assert serve["otlp_traces_client_sample_ratio"] == (
        tracing["clientSampleRatio"] if tracing["otlpEndpoint"] else None)
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
