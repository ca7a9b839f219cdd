"""The chart's TLS and api key wiring: the TLS key and the api key reach the head only, a
worker's drain hook the CA, and with clientAuth its own certificate."""

from __future__ import annotations

from helm_render import (TLS_DIR, _cli_args, _container, _groups, _one, _prestop, _render,
                         _serve_argv, pod_templates, validate_all)


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
