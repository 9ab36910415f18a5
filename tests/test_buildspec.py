"""buildspec.yml run for real with bash, as CodeBuild runs it (its variables unless the
project sets them, then every phase's commands in one shell), with ``aws``, ``docker`` and ``git`` replaced by programs
that record their arguments: the tag computation, repository creation, both flavours,
layer reuse and the artifact are checked without AWS or a Docker engine."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SPEC = yaml.safe_load((REPO / "buildspec.yml").read_text())
SHA = "0123456789abcdef0123456789abcdef01234567"

FAKE = r"""#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$CALLS"
case "$(basename "$0") $1 $2" in
  "aws sts get-caller-identity") echo 123456789012 ;;
  "aws ecr describe-repositories") exit "${REPO_MISSING:-0}" ;;
  "aws ecr get-login-password") echo secret ;;
  "docker login"*) cat > /dev/null ;;
  "docker build"*) [[ "$*" != *"Dockerfile.${FAIL_FLAVOUR:-none}"* ]] || exit 1 ;;
  "git rev-parse HEAD") [[ -n "${GIT_COMMIT:-}" ]] && echo "$GIT_COMMIT" || exit 128 ;;
esac
"""


def run_buildspec(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("aws", "docker", "git"):
        (bin_dir / tool).write_text(FAKE)
        (bin_dir / tool).chmod(0o755)
    workdir = tmp_path / "src"
    workdir.mkdir()
    script = []
    for name, value in SPEC["env"]["variables"].items():  # the project's values win over these
        script.append(f'export {name}="${{{name}-{value}}}"')
    for phase in ("pre_build", "build", "post_build"):
        script += SPEC["phases"][phase]["commands"]
    calls = tmp_path / "calls"
    full_env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "CALLS": str(calls),
        "AWS_DEFAULT_REGION": "us-east-1",
        "CODEBUILD_BUILD_SUCCEEDING": "1",
        **env,
    }
    out = subprocess.run(
        ["bash", "-e", "-c", "\n".join(script)], cwd=workdir, env=full_env, capture_output=True, text=True, timeout=60
    )
    return out, calls.read_text().splitlines() if calls.exists() else [], workdir


def test_builds_and_pushes_both_flavours_reusing_the_previous_image(tmp_path):
    out, calls, workdir = run_buildspec(tmp_path, CODEBUILD_RESOLVED_SOURCE_VERSION=SHA)
    assert out.returncode == 0, out.stderr
    repo = "123456789012.dkr.ecr.us-east-1.amazonaws.com/sagemaker-tiered-kvcache"
    builds = [c for c in calls if c.startswith("docker build")]
    assert [re.search(r"Dockerfile\.(\w+)", b).group(1) for b in builds] == ["gpu", "cpu"]
    for flavour, build in zip(("gpu", "cpu"), builds):
        assert f"--cache-from {repo}:cache-{flavour}" in build
        assert "--build-arg BUILDKIT_INLINE_CACHE=1" in build
        assert f"-t {repo}:0123456789ab-{flavour}" in build and f"-t {repo}:cache-{flavour}" in build
    pushes = [c.split()[-1] for c in calls if c.startswith("docker push")]
    assert pushes == [f"{repo}:0123456789ab-gpu", f"{repo}:cache-gpu", f"{repo}:0123456789ab-cpu", f"{repo}:cache-cpu"]
    assert not any("create-repository" in c for c in calls)
    assert json.loads((workdir / "imageDetail.json").read_text()) == {"ImageURI": f"{repo}:0123456789ab-gpu"}
    assert "latest" not in " ".join(calls)
    assert set(SPEC["env"]["exported-variables"]) == {"IMAGE_TAG", "IMAGE_REPO_URI"}


def test_creates_the_repository_when_missing(tmp_path):
    out, calls, _ = run_buildspec(tmp_path, CODEBUILD_RESOLVED_SOURCE_VERSION=SHA, REPO_MISSING="254")
    assert out.returncode == 0, out.stderr
    (create,) = [c for c in calls if "create-repository" in c]
    assert "--repository-name sagemaker-tiered-kvcache" in create and "scanOnPush=true" in create
    assert calls.index(create) < min(i for i, c in enumerate(calls) if c.startswith("docker push"))


@pytest.mark.parametrize(
    "env,tag",
    [
        (
            {"CODEBUILD_RESOLVED_SOURCE_VERSION": "", "GIT_COMMIT": "fedcba9876543210fedcba9876543210fedcba98"},
            "fedcba987654",
        ),
        ({"CODEBUILD_RESOLVED_SOURCE_VERSION": "3sL4kqtJ+rmSp/Xd3dIbrHY"}, "3sL4kqtJ-rmS"),  # an S3 object version
        ({"CODEBUILD_RESOLVED_SOURCE_VERSION": ".hidden"}, "_hidden"),
    ],
)
def test_tag_without_a_commit_from_codebuild(tmp_path, env, tag):
    out, calls, _ = run_buildspec(tmp_path, **env)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", tag)
    assert any(c.endswith(f":{tag}-gpu") for c in calls if c.startswith("docker push"))


def test_tag_falls_back_to_the_build_time(tmp_path):
    out, calls, _ = run_buildspec(tmp_path, CODEBUILD_RESOLVED_SOURCE_VERSION="")
    assert out.returncode == 0, out.stderr
    pushed = [c.split()[-1] for c in calls if c.startswith("docker push")][0]
    assert re.search(r":build-\d{8}-\d{6}-gpu$", pushed), pushed


def test_a_failed_build_pushes_nothing_of_it_and_fails(tmp_path):
    out, calls, workdir = run_buildspec(
        tmp_path, CODEBUILD_RESOLVED_SOURCE_VERSION=SHA, FAIL_FLAVOUR="gpu", IMAGE_FLAVOURS="gpu cpu"
    )
    assert out.returncode != 0
    assert not any(c.startswith("docker push") for c in calls)
    assert SPEC["phases"]["build"]["on-failure"] == "ABORT"  # CodeBuild skips post_build then
    assert not (workdir / "imageDetail.json").exists()


def test_one_flavour_only(tmp_path):
    out, calls, workdir = run_buildspec(tmp_path, CODEBUILD_RESOLVED_SOURCE_VERSION=SHA, IMAGE_FLAVOURS="cpu")
    assert out.returncode == 0, out.stderr
    assert [c for c in calls if c.startswith("docker build")][0].count("Dockerfile.cpu") == 1
    assert json.loads((workdir / "imageDetail.json").read_text())["ImageURI"].endswith(":0123456789ab-cpu")
