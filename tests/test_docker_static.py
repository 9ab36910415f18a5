"""Static checks of the images, the entrypoint, install.sh and buildspec (no Docker engine here)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = [REPO / "docker" / "Dockerfile.gpu", REPO / "docker" / "Dockerfile.cpu"]
ENTRYPOINT = REPO / "entrypoint.sh"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def resolve_args(ins: list[tuple[str, str]], text: str) -> str:
    defaults = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            defaults[k] = v
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m.group(1) or m.group(2), m.group(0)), text)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(path):
    ins = instructions(path)
    froms = [resolve_args(ins, rest).split()[0] for word, rest in ins if word == "FROM"]
    assert froms
    stages = {rest.split()[-1] for word, rest in ins if word == "FROM" and " AS " in rest.upper()}
    for image in froms:
        if image in stages:
            continue
        assert "$" not in image, f"unresolved base image {image}"
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        assert tag and name, f"{image} has no tag"
        assert tag != "latest" and "latest" not in image, f"{image} is not pinned"
        assert re.search(r"\d", tag), f"{image}: tag {tag!r} names no version"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_sagemaker_contract(path):
    ins = instructions(path)
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    words = [w for w, _ in final]
    labels = " ".join(rest for w, rest in final if w == "LABEL")
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in labels
    assert ("EXPOSE", "8080") in final
    entry = [rest for w, rest in final if w == "ENTRYPOINT"]
    assert len(entry) == 1
    argv = json.loads(entry[0])  # exec form: a JSON array, so SIGTERM reaches the server
    assert argv == ["/opt/program/entrypoint.sh"]
    assert [json.loads(rest) for w, rest in final if w == "CMD"] == [["serve"]]
    runs = " ".join(rest for w, rest in final if w == "RUN")
    flavour = path.name.split(".")[-1]
    assert f"bash docker/install.sh {flavour}" in runs
    assert "COPY" in words and "pip install -e" not in runs  # installs only via install.sh


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_builds_and_bundles_the_curvine_sdk(path):
    """Both images build the SDK in a builder stage on their own base (same Python and
    glibc as the wheel's user) and install the wheel through install.sh."""
    ins = instructions(path)
    text = " ".join(f"{w} {r}" for w, r in ins)
    froms = [r for w, r in ins if w == "FROM"]
    assert len(froms) == 2 and froms[0].upper().endswith("AS CURVINE-BUILDER")
    assert froms[0].split()[0] == froms[1].split()[0]  # the builder's base is the final image's
    args = dict(r.split("=", 1) for w, r in ins if w == "ARG" and "=" in r)
    assert re.fullmatch(r"v\d+\.\d+\.\d+", args["CURVINE_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["RUST_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["MATURIN_VERSION"])
    assert "--branch \"${CURVINE_VERSION}\"" in text and "maturin build" in text
    assert "rustup" in text and "protoc" in text
    assert "COPY --from=curvine-builder /wheels" in text and "CURVINE_WHEEL=" in text
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    install = [r for w, r in final if w == "RUN" and "docker/install.sh" in r]
    assert install and 'CURVINE_WHEEL="$(ls /opt/wheels/curvine/*.whl)"' in install[0]


def test_image_bases_and_curvine_release_agree():
    gpu, cpu = (dict(r.split("=", 1) for w, r in instructions(p) if w == "ARG" and "=" in r)
                for p in DOCKERFILES)
    assert re.fullmatch(r"vllm/vllm-openai:v0\.32\.\d+", gpu["VLLM_IMAGE"])
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", cpu["PYTHON_IMAGE"])
    for name in ("CURVINE_VERSION", "RUST_VERSION", "MATURIN_VERSION"):
        assert gpu[name] == cpu[name], name
    # The compose cluster runs the Curvine release both images build their SDK from.
    compose = yaml.safe_load((REPO / "docker" / "compose.curvine.yml").read_text())
    assert compose["x-curvine"]["image"].endswith(":" + gpu["CURVINE_VERSION"])
    assert compose["services"]["kvcache"]["build"]["dockerfile"] == "docker/Dockerfile.cpu"


def test_entrypoint_is_executable_and_execs():
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert re.search(r'exec "\$python" -m serving', text)
    assert 'exec "$@"' in text
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)


def fake_python(tmp_path: Path) -> Path:
    py = tmp_path / "fakepython"
    py.write_text('#!/bin/sh\necho "pid=$$ args=$*"\n')
    py.chmod(0o755)
    return py


def test_serve_execs_the_server_in_place(tmp_path):
    """``serve`` replaces the shell (same PID), so SIGTERM goes to the server itself."""
    env = dict(os.environ, PYTHON=str(fake_python(tmp_path)))
    proc = subprocess.Popen(["bash", str(ENTRYPOINT), "serve"], stdout=subprocess.PIPE, text=True, env=env)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == f"pid={proc.pid} args=-m serving"


def test_other_commands_run_as_given(tmp_path):
    proc = subprocess.Popen(["bash", str(ENTRYPOINT), "sh", "-c", "echo $$ ran"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == f"{proc.pid} ran"


def test_install_script():
    script = REPO / "docker" / "install.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert '".[${extras}]"' in text and 'extras="cpu,test"' in text and 'extras="gpu"' in text
    assert "uninstall -y torchvision torchaudio torchcodec" in text
    assert '${VENV:-$root/.venv}' in text and "--system-site-packages" in text
    bad = subprocess.run(["bash", str(script), "tpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_buildspec():
    spec = yaml.safe_load((REPO / "buildspec.yml").read_text())
    assert str(spec["version"]) == "0.2"
    cmds = " ".join(c for phase in spec["phases"].values() for c in phase["commands"])
    assert "aws ecr get-login-password" in cmds and "docker login" in cmds
    assert "CODEBUILD_RESOLVED_SOURCE_VERSION" in cmds
    assert 'docker build -f "docker/Dockerfile.${IMAGE_FLAVOUR}"' in cmds and "docker push" in cmds
    assert "AWS_ACCOUNT_ID" in cmds and "AWS_REGION" in cmds and "IMAGE_REPO_NAME" in cmds
    assert "latest" not in cmds
