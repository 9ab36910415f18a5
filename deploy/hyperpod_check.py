"""Check a HyperPod InferenceEndpointConfig before ``kubectl apply``: the operator's own
CRD schema, then what the pod it makes can actually see.

Runs on an operator's machine or in the tests, never in the container:

    python deploy/hyperpod_check.py deploy/hyperpod_inference_endpoint.yaml

1. **Schema.** The manifest is validated against the ``openAPIV3Schema`` of its
   ``apiVersion`` in ``deploy/schemas/inferenceendpointconfigs.crd.yaml`` (the operator's
   CRD, kept verbatim with its source). Unknown fields are errors, as with ``kubectl
   apply``'s default strict field validation, except where the schema preserves them.
2. **The pod.** The worker container mounts the model volume (``worker.modelVolumeMount``)
   and nothing else: the CRD has no worker ``volumeMounts`` (``spec.kubernetes.volumes``
   reach init containers only). So every file a setting names must lie in the model
   volume, and the shared tier cannot be a ``file://`` mount. A shared tier needs a way to
   reach Curvine (``KVCACHE_CURVINE_MASTERS``, or ``KVCACHE_CURVINE_CONF`` inside the model
   volume) and a signing key taken from a Kubernetes Secret, never written in the manifest.
"""

from __future__ import annotations

import argparse
import copy
import functools
import posixpath
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import jsonschema
import yaml

CRD_FILE = Path(__file__).resolve().parent / "schemas" / "inferenceendpointconfigs.crd.yaml"
# Settings whose value is a file the container opens (absolute, or relative to the model
# folder): they must lie in the model volume, the one volume the worker mounts.
FILE_SETTINGS = ("KVCACHE_CURVINE_CONF", "KVCACHE_WARM_PROMPTS")
_HOST_PORT = re.compile(r"^[A-Za-z0-9.-]+:\d{1,5}$")


@functools.lru_cache(maxsize=None)
def _crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def crd_schema(version: str) -> dict[str, Any]:
    """The CRD's openAPIV3Schema for ``version`` (``v1`` ...), made strict: an object with
    listed properties refuses others unless the schema says to keep unknown fields."""
    for entry in _crd()["spec"]["versions"]:
        if entry["name"] == version:
            return _strict(copy.deepcopy(entry["schema"]["openAPIV3Schema"]))
    served = [entry["name"] for entry in _crd()["spec"]["versions"]]
    raise ValueError(f"the CRD serves no version {version!r} (it serves {served})")


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


def schema_errors(manifest: dict[str, Any]) -> list[str]:
    group, _, version = str(manifest.get("apiVersion", "")).partition("/")
    crd = _crd()["spec"]
    if group != crd["group"] or manifest.get("kind") != crd["names"]["kind"]:
        return [
            f"apiVersion/kind {manifest.get('apiVersion')}/{manifest.get('kind')} is not "
            f"{crd['group']}/*, {crd['names']['kind']}"
        ]
    try:
        schema = crd_schema(version)
    except ValueError as e:
        return [str(e)]
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}"
        for error in sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.path)))
    ]


def _env(worker: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item.get("name"): item for item in worker.get("environmentVariables") or []}


def pod_errors(manifest: dict[str, Any]) -> list[str]:
    """What the worker container can see, checked against the settings that use it."""
    worker = (manifest.get("spec") or {}).get("worker") or {}
    mount = posixpath.normpath((worker.get("modelVolumeMount") or {}).get("mountPath") or "/opt/ml/model")
    env = _env(worker)
    errors: list[str] = []
    names = [item.get("name") for item in worker.get("environmentVariables") or []]
    errors += [f"{name} is set twice" for name in sorted({n for n in names if names.count(n) > 1})]

    def literal(name: str) -> str | None:
        item = env.get(name)
        return None if item is None else str(item.get("value", ""))

    for name in FILE_SETTINGS:
        value = literal(name)
        if value and value.startswith("/") and not _inside(value, mount):
            errors.append(
                f"{name}={value} is outside the model volume ({mount}), the only "
                "volume the worker mounts: put the file in the model artifact"
            )
    shared = literal("KVCACHE_SHARED_URL") or ""
    if shared.startswith("file:"):
        errors.append(
            f"KVCACHE_SHARED_URL={shared}: the worker cannot mount a shared volume "
            "(the CRD has no worker volumeMounts); use curvine:// with "
            "KVCACHE_CURVINE_MASTERS"
        )
    if shared.startswith("curvine:") and not (env.get("KVCACHE_CURVINE_MASTERS") or env.get("KVCACHE_CURVINE_CONF")):
        errors.append(
            "KVCACHE_SHARED_URL=curvine://... needs KVCACHE_CURVINE_MASTERS "
            "(or KVCACHE_CURVINE_CONF inside the model volume)"
        )
    masters = literal("KVCACHE_CURVINE_MASTERS")
    if masters is not None and not all(_HOST_PORT.match(m.strip()) for m in masters.split(",")):
        errors.append(f"KVCACHE_CURVINE_MASTERS={masters!r}: want host:port[,host:port...]")
    if shared:
        key = env.get("KVCACHE_SIGNING_KEY")
        if key is None:
            errors.append("a shared tier needs KVCACHE_SIGNING_KEY (from a Secret)")
        elif "value" in key or "secretKeyRef" not in (key.get("valueFrom") or {}):
            errors.append(
                "KVCACHE_SIGNING_KEY must come from a Secret (valueFrom.secretKeyRef), not be written in the manifest"
            )
    return errors


def _inside(path: str, folder: str) -> bool:
    path = posixpath.normpath(path)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def problems(manifest: dict[str, Any]) -> list[str]:
    errors = schema_errors(manifest)
    return errors or pod_errors(manifest)


def check_files(paths: Iterable[Path]) -> dict[str, list[str]]:
    """Problems per document (``FILE`` or ``FILE#N`` for multi-document files)."""
    found: dict[str, list[str]] = {}
    for path in paths:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
        for i, doc in enumerate(docs):
            found[f"{path}#{i}" if len(docs) > 1 else str(path)] = problems(doc)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifests", nargs="+", type=Path)
    found = check_files(parser.parse_args(argv).manifests)
    for where, errors in found.items():
        for error in errors:
            print(f"{where}: {error}")
        if not errors:
            print(f"{where}: ok")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
