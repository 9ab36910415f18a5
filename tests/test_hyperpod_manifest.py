"""deploy/hyperpod_inference_endpoint.yaml against the HyperPod inference operator's own
CRD schema (kept verbatim in deploy/schemas/) and against what its pod can see."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "deploy" / "hyperpod_inference_endpoint.yaml"
sys.path.insert(0, str(REPO / "deploy"))
import hyperpod_check as check  # noqa: E402


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def env_list(doc: dict) -> list[dict]:
    return doc["spec"]["worker"]["environmentVariables"]


def set_env(doc: dict, name: str, **entry) -> dict:
    doc = copy.deepcopy(doc)
    items = [e for e in env_list(doc) if e["name"] != name]
    doc["spec"]["worker"]["environmentVariables"] = items + [{"name": name, **entry}]
    return doc


def test_schema_file_is_the_operators_crd_unchanged():
    """The header names the upstream blob; the text below it must hash to exactly that."""
    text = check.CRD_FILE.read_text()
    header, _, body = text.partition("# --- end of header ---\n")
    blob = next(line.split()[2] for line in header.splitlines() if line.startswith("#   blob:"))
    assert "github.com/aws/sagemaker-hyperpod-cli/blob/" in header and "commit:" in header
    digest = (
        subprocess.run(["git", "hash-object", "--stdin"], input=body.encode(), capture_output=True, check=True)
        .stdout.decode()
        .strip()
    )
    assert digest == blob
    crd = yaml.safe_load(body)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "InferenceEndpointConfig"


def test_the_example_manifest_passes_schema_and_pod_checks():
    doc = manifest()
    assert check.schema_errors(doc) == []
    assert check.pod_errors(doc) == []
    env = {e["name"]: e for e in env_list(doc)}
    assert env["KVCACHE_SHARED_URL"]["value"].startswith("curvine://")
    assert env["KVCACHE_SIGNING_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "kvcache-signing-key", "key": "key"}
    assert doc["spec"]["worker"]["modelInvocationPort"]["containerPort"] == 8080
    assert doc["spec"]["loadBalancer"]["healthCheckPath"] == "/ping"
    assert (
        subprocess.run(
            [sys.executable, str(REPO / "deploy" / "hyperpod_check.py"), str(MANIFEST)], capture_output=True, text=True
        ).returncode
        == 0
    )


def test_schema_is_strict_like_kubectl_apply():
    doc = manifest()
    bad = copy.deepcopy(doc)
    bad["spec"]["worker"]["volumeMounts"] = [{"name": "curvine", "mountPath": "/etc/curvine"}]
    assert any("volumeMounts" in e for e in check.schema_errors(bad))
    bad = copy.deepcopy(doc)
    bad["spec"]["intelligentRoutingSpec"]["routingStrategy"] = "prefix-aware"
    assert any("routingStrategy" in e for e in check.schema_errors(bad))
    bad = copy.deepcopy(doc)
    del bad["spec"]["worker"]["modelVolumeMount"]
    assert any("modelVolumeMount" in e for e in check.schema_errors(bad))
    bad = set_env(doc, "KVCACHE_SIGNING_KEY", valueFrom={"secretKeyRef": {"name": "kvcache-signing-key"}})
    assert any("'key' is a required property" in e for e in check.schema_errors(bad))
    assert check.schema_errors({**doc, "apiVersion": "inference.sagemaker.aws.amazon.com/v9"})


def test_the_worker_can_mount_nothing_but_the_model():
    """The fact docs/curvine.md and the manifest rest on: the CRD gives the worker no
    volumeMounts; spec.kubernetes.volumes reach init containers only."""
    spec = check.crd_schema("v1")["properties"]["spec"]["properties"]
    worker = spec["worker"]["properties"]
    assert "modelVolumeMount" in worker and "volumeMounts" not in worker and "volumes" not in worker
    assert "init containers" in spec["kubernetes"]["properties"]["volumes"]["description"]
    # Environment variables may come from Secrets.
    assert "secretKeyRef" in worker["environmentVariables"]["items"]["properties"]["valueFrom"]["properties"]


@pytest.mark.parametrize(
    "name,entry,message",
    [
        ("KVCACHE_CURVINE_CONF", {"value": "/etc/curvine/curvine-cluster.toml"}, "outside the model volume"),
        ("KVCACHE_WARM_PROMPTS", {"value": "/data/warm.jsonl"}, "outside the model volume"),
        ("KVCACHE_SHARED_URL", {"value": "file:///mnt/curvine/kvcache/m"}, "cannot mount a shared volume"),
        ("KVCACHE_CURVINE_MASTERS", {"value": "curvine-master"}, "host:port"),
        ("KVCACHE_SIGNING_KEY", {"value": "written-in-the-manifest"}, "must come from a Secret"),
        ("SM_NUM_GPUS", {"value": "8"}, "set twice"),
    ],
)
def test_pod_checks_refuse_what_the_pod_cannot_see(name, entry, message):
    doc = set_env(manifest(), name, **entry)
    if name == "SM_NUM_GPUS":
        env_list(doc).append({"name": "SM_NUM_GPUS", "value": "4"})
    assert check.schema_errors(doc) == []  # each is valid for the schema ...
    assert any(message in e for e in check.pod_errors(doc))  # ... and would fail in the pod


def test_pod_checks_accept_files_in_the_model_and_need_a_way_to_curvine():
    doc = set_env(manifest(), "KVCACHE_CURVINE_CONF", value="curvine/curvine-cluster.toml")
    assert check.pod_errors(doc) == []
    doc = set_env(doc, "KVCACHE_WARM_PROMPTS", value="/opt/ml/model/warm.jsonl")
    assert check.pod_errors(doc) == []
    doc = copy.deepcopy(manifest())
    doc["spec"]["worker"]["environmentVariables"] = [
        e for e in env_list(doc) if e["name"] not in ("KVCACHE_CURVINE_MASTERS", "KVCACHE_SIGNING_KEY")
    ]
    errors = check.pod_errors(doc)
    assert any("needs KVCACHE_CURVINE_MASTERS" in e for e in errors)
    assert any("needs KVCACHE_SIGNING_KEY" in e for e in errors)


def test_main_reports_problems_per_document(tmp_path, capsys):
    bad = set_env(manifest(), "KVCACHE_CURVINE_CONF", value="/etc/curvine/curvine-cluster.toml")
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([manifest(), bad]))
    assert check.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}#0: ok" in out and f"{path}#1: KVCACHE_CURVINE_CONF=/etc/curvine" in out
