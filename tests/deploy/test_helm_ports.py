"""The chart's ports: the head's container ports, the Services and ServiceMonitor in front
of them, one port per router replica's /metrics, the HTTP toggle, and the head's probes."""

from __future__ import annotations

import pytest

from helm_render import (RELEASE, _cli_args, _container, _groups, _one, _render, _serve_argv,
                         validate_all)


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
