"""deploy/ray/*.yaml: every `ray up` config passes Ray's own validation, and pdserve's
roles are wired through it (the head serves; prefill and decode workers each have their
own nodes; the serve command asks for no more workers than those nodes can hold).

Validation is the part of `ray up` that runs before any cloud is touched
(`ray.autoscaler._private.commands._bootstrap_config`): `prepare_config` merges the
provider's defaults.yaml (for `local`, `prepare_local` first builds the single node type
from head_ip / worker_ips), then `validate_config` checks ray-schema.json and the
cross-field rules. The provider's own bootstrap that `ray up` runs in between (AWS: IAM,
subnets, instance-type lookup) is left out: the tests make no network call, and the
`no_network` fixture makes sure of it.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import click
import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[2]
RAY_DIR = REPO / "deploy" / "ray"
CONFIGS = sorted(RAY_DIR.glob("*.yaml"))
ROLES = ("prefill", "decode")
# Every flag the cluster configs must pass to `pdserve serve` (the multi-node contract).
REQUIRED_SERVE_FLAGS = {
    "--address", "--host", "--port", "--metrics-port", "--kv-host", "--prefill-workers",
    "--decode-workers", "--prefill-resources", "--decode-resources", "--gpus-per-worker",
    "--dtype", "--transport", "--model"}


def load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def ray_validate(raw: dict) -> dict:
    """What `ray up` checks before it launches anything; returns the prepared config."""
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    return cfg


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a cluster config check tried to reach the network")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


class _Parsed(Exception):
    """Carries the Namespace out of pdserve's CLI before it starts anything."""


def parse_with_pdserve_cli(argv: list[str], monkeypatch) -> argparse.Namespace:
    """`pdserve <argv>` through pdserve's own argument parser, stopping right after
    parsing: an unknown, misspelt or ill-typed flag fails here as it would on the head."""
    from pdserve import cli

    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        try:
            cli.main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit as e:
            raise AssertionError(f"pdserve {shlex.join(argv)}: rejected (exit {e.code})") from None
    raise AssertionError("pdserve's CLI did not parse its arguments")


def serve_command(cfg: dict) -> tuple[int, str]:
    cmds = cfg["head_start_ray_commands"]
    found = [(i, c) for i, c in enumerate(cmds) if "pdserve serve" in c]
    assert len(found) == 1, f"expected one `pdserve serve` in head_start_ray_commands: {cmds}"
    return found[0]


def serve_env(cfg: dict) -> dict[str, str]:
    """The NAME=value assignments before `nohup pdserve serve` (values unexpanded)."""
    _, cmd = serve_command(cfg)
    words = shlex.split(cmd)
    at = words.index("nohup")
    assert all(re.fullmatch(r"[A-Z_]+=.*", w) for w in words[:at]), cmd
    return dict(w.split("=", 1) for w in words[:at])


def serve_args(cfg: dict, monkeypatch) -> argparse.Namespace:
    _, cmd = serve_command(cfg)
    words = shlex.split(cmd)
    words = words[len(serve_env(cfg)):]
    redirects = next(i for i, w in enumerate(words) if w[0] in "<>&" or w[:2] == "2>")
    assert words[:3] == ["nohup", "pdserve", "serve"], cmd
    flags = words[3:redirects]
    missing = REQUIRED_SERVE_FLAGS - set(flags)
    assert not missing, f"pdserve serve in head_start_ray_commands lacks {sorted(missing)}"
    return parse_with_pdserve_cli(["serve", *flags], monkeypatch)


def role_nodes(raw: dict, cfg: dict) -> list[tuple[str, dict, int]]:
    """(name, Ray resources, most nodes) of every worker node kind.

    AWS & co.: the node types. `local`: one node per worker IP, whose resources come from
    the role table in worker_start_ray_commands (`ray start --resources`), because the
    local provider allows no node types of our own.
    """
    if raw["provider"]["type"] != "local":
        return [(name, t["resources"], t["max_workers"])
                for name, t in cfg["available_node_types"].items()
                if name != cfg["head_node_type"]]
    table_cmds = [c for c in cfg["worker_start_ray_commands"] if "ROLE_RESOURCES" in c]
    assert len(table_cmds) == 1, cfg["worker_start_ray_commands"]
    table = re.findall(r"""\*" ([\d.]+) "\*\) ROLE_RESOURCES='(\{[^']*\})'""", table_cmds[0])
    assert '--resources="$ROLE_RESOURCES"' in table_cmds[0]
    ips = [ip for ip, _ in table]
    assert sorted(ips) == sorted(raw["provider"]["worker_ips"]), \
        "every worker_ips entry needs exactly one line in the role table"
    assert raw["provider"]["head_ip"] not in ips
    return [(ip, json.loads(res), 1) for ip, res in table]


def test_every_config_is_found():
    assert {p.name for p in CONFIGS} >= {"cluster.yaml", "cluster-local.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ray_accepts_the_config(path):
    cfg = ray_validate(load(path))
    assert cfg["head_node_type"] in cfg["available_node_types"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_typo_in_a_key_fails_validation(path):
    broken = load(path)
    broken["worker_start_ray_command"] = broken.pop("worker_start_ray_commands")
    with pytest.raises(jsonschema.ValidationError, match="worker_start_ray_command"):
        ray_validate(broken)


@pytest.mark.parametrize("path", [p for p in CONFIGS if "available_node_types" in load(p)],
                         ids=lambda p: p.name)
def test_a_typo_in_a_node_type_fails_validation(path):
    raw = load(path)
    for name in raw["available_node_types"]:
        broken = copy.deepcopy(raw)
        node_type = broken["available_node_types"][name]
        node_type["resource"] = node_type.pop("resources")
        with pytest.raises(jsonschema.ValidationError):
            ray_validate(broken)
    broken = copy.deepcopy(raw)
    broken["available_node_types"]["prefill"]["resources"]["GPU"] = "8"
    with pytest.raises(jsonschema.ValidationError, match="'8' is not of type 'integer'"):
        ray_validate(broken)


def test_local_provider_rejects_node_types():
    """Why cluster-local.yaml declares each node's role with `ray start --resources`."""
    raw = load(RAY_DIR / "cluster-local.yaml")
    raw["available_node_types"] = {"prefill": {"resources": {"pdserve_prefill": 8},
                                               "node_config": {}}}
    with pytest.raises(click.ClickException):
        ray_validate(raw)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_head_runs_pdserve_serve_detached_after_ray(path, monkeypatch):
    cfg = ray_validate(load(path))
    cmds = cfg["head_start_ray_commands"]
    ray_head = [i for i, c in enumerate(cmds) if "ray start --head" in c]
    at, cmd = serve_command(cfg)
    assert ray_head and ray_head[0] < at, cmds
    assert cmd.rstrip().endswith("&"), f"serve runs in the foreground: detach it: {cmd}"
    args = serve_args(cfg, monkeypatch)
    assert args.address == "auto" and args.host == "0.0.0.0" and args.kv_host == "auto"
    assert (args.port, args.metrics_port) == (50051, 9464)
    assert args.routers == 2             # a router's death costs its own connections only
    # GPU workers: flash-attn runs in bfloat16/float16 only (the CLI's default is float32)
    assert args.gpus_per_worker >= 1 and args.dtype in ("bfloat16", "float16")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_prefill_and_decode_have_their_own_nodes(path, monkeypatch):
    raw = load(path)
    cfg = ray_validate(raw)
    args = serve_args(cfg, monkeypatch)
    nodes = role_nodes(raw, cfg)
    head = cfg["available_node_types"][cfg["head_node_type"]]["resources"]
    for role in ROLES:
        (key,) = getattr(args, f"{role}_resources")
        assert key == f"pdserve_{role}"
        assert key not in head, "no worker belongs on the head"
        assert any(key in res for _, res, _ in nodes), f"no node declares {key}"
    for name, res, _ in nodes:
        assert sum(f"pdserve_{r}" in res for r in ROLES) == 1, \
            f"{name} must be a prefill or a decode node: {res}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serve_asks_for_no_more_workers_than_the_nodes_hold(path, monkeypatch):
    raw = load(path)
    cfg = ray_validate(raw)
    args = serve_args(cfg, monkeypatch)
    nodes = role_nodes(raw, cfg)
    for role in ROLES:
        want = getattr(args, f"{role}_workers")
        per_worker = getattr(args, f"{role}_resources")
        key = f"pdserve_{role}"
        mine = [(res, n) for _, res, n in nodes if key in res]
        slots = sum(n * (res[key] // per_worker[key]) for res, n in mine)
        assert 1 <= want <= slots, f"--{role}-workers {want}: the {role} nodes hold {slots}"
        if all("GPU" in res for res, _ in mine):   # local: GPUs are detected per host
            gpus = sum(n * res["GPU"] for res, n in mine)
            assert want * args.gpus_per_worker <= gpus, \
                f"{want} {role} workers x {args.gpus_per_worker} GPU > {gpus} GPUs"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_docker_runs_the_pdserve_image(path):
    docker = load(path)["docker"]
    assert docker["image"].split("/")[-1].startswith("pdserve:")
    # deploy/docker/Dockerfile's ENTRYPOINT is `pdserve`; Ray runs the container with
    # `bash` as its command, which would become `pdserve bash`.
    assert "--entrypoint=''" in docker["run_options"]


def start_commands(cfg: dict) -> list[str]:
    return cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ray_runs_with_token_auth_on_every_node(path):
    """Every command that starts or asks Ray (ray start, ray status, pdserve serve) runs
    with RAY_AUTH_MODE=token, and every node gets the launching machine's token."""
    raw = load(path)
    cfg = ray_validate(raw)
    talking = [c for c in start_commands(cfg) if re.search(r"\bray (start|status)\b", c)]
    assert len(talking) == 3, talking       # head start, the wait for workers, worker start
    for cmd in talking:
        for m in re.finditer(r"\bray (start|status)\b", cmd):
            before = cmd[:m.start()]
            assert re.search(r"(export |\s|^)RAY_AUTH_MODE=token[; ]", before), cmd
    assert serve_env(cfg)["RAY_AUTH_MODE"] == "token"
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_dashboard_stays_on_the_heads_loopback(path):
    cfg = ray_validate(load(path))
    (head_start,) = [c for c in cfg["head_start_ray_commands"] if "ray start --head" in c]
    assert re.findall(r"--dashboard-host[= ](\S+)", head_start) == ["127.0.0.1"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_head_makes_an_admin_key_once_and_serve_reads_it(path, tmp_path):
    """The router binds 0.0.0.0, so Drain and Scale need its admin key: the head makes
    one (owner-only, kept across `ray up` reruns) and `serve` reads it from the env."""
    cfg = ray_validate(load(path))
    cmds = cfg["head_start_ray_commands"]
    at, _ = serve_command(cfg)
    (make_at,) = [i for i, c in enumerate(cmds) if "admin-api-key" in c and i != at]
    assert make_at < at
    env = {"HOME": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    subprocess.run(["bash", "-c", cmds[make_at]], env=env, check=True)
    key_file = tmp_path / ".pdserve" / "admin-api-key"
    key = key_file.read_text().strip()
    assert len(key) >= 32
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert key_file.parent.stat().st_mode & 0o777 == 0o700
    subprocess.run(["bash", "-c", cmds[make_at]], env=env, check=True)
    assert key_file.read_text().strip() == key                      # made once
    got = subprocess.run(["bash", "-c", f'echo {serve_env(cfg)["PDSERVE_ADMIN_API_KEY"]}'],
                         env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert got == key


def dockerfile_arg(name: str) -> str:
    text = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", text, re.MULTILINE)
    return value


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_setup_installs_pdserve_with_the_image_versions(path):
    """Without the docker section, the setup commands build what the image has."""
    setup = " ".join(load(path)["setup_commands"])
    (torch_pin,) = re.findall(r'^  "(torch==[^"]+)",', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert f'"{torch_pin}" --index-url https://download.pytorch.org/whl/cu12' in setup
    assert f"torch=={dockerfile_arg('TORCH_VERSION')}" == torch_pin
    assert f"flash-attn=={dockerfile_arg('FLASH_ATTN_VERSION')}" in setup
    assert f"ray[default]=={dockerfile_arg('RAY_VERSION')}" in setup
    assert '"$HOME/pdserve[gpu,nixl]"' in setup
    assert setup.index("torch==") < setup.index("flash-attn==") < setup.index("pdserve[gpu,nixl]")
    # the check that skips the installs names the nixl extra's distribution
    pyproject = (REPO / "pyproject.toml").read_text()
    (nixl_dist,) = re.findall(r'^nixl = \["([A-Za-z0-9_.-]+?)[<>=!~\[;"]', pyproject, re.MULTILINE)
    assert f"'{nixl_dist}')]" in setup
    mounts = load(path)["file_mounts"]
    assert mounts.get("~/pdserve") == "."
