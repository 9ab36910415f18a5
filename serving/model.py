"""Which model to serve, where its files are, and getting them there.

Runs in the server process: ``resolve_model`` at configuration (before the port is
bound; it may generate the default model or fetch one ``config.json``), ``fetch_model``
from the engine's start-up thread (an S3 model's files, before vLLM starts; ``/ping``
answers 503 meanwhile). Nothing here runs on the event loop.

The model, first match wins:

1. ``SM_VLLM_MODEL`` (vLLM's ``--model``, as the SageMaker vLLM container takes it),
   ``HF_MODEL_ID`` (TGI), ``OPTION_MODEL_ID`` (LMI; also ``option.model_id`` in the model
   folder's ``serving.properties``): a hub id (``org/name``), a local folder, or an
   ``s3://bucket/prefix`` downloaded with boto3 under ``SERVING_DOWNLOAD_DIR``;
2. the SageMaker model folder (``/opt/ml/model``; ``SAGEMAKER_BASE_DIR`` moves ``/opt/ml``)
   when it holds ``config.json``, or when exactly one folder inside it does (a tarball
   with a top folder unpacks that way);
3. the small generated model (``serving.default_model``), when chosen
   (``SERVING_DEFAULT_MODEL=true``) or when there is no SageMaker model folder at all: a
   local run on a bare machine. A SageMaker model folder that exists but holds no model,
   with no model named, is a configuration error: the server never serves a random model
   in place of the one a deployment forgot to ship.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional

from cache.errors import ConfigError, FootprintError
from cache.flags import parse_bool
from cache.footprint import load_hf_config
from cache.weights import S3_MANIFEST

log = logging.getLogger(__name__)

MODEL_VARIABLES = ("SM_VLLM_MODEL", "HF_MODEL_ID", "OPTION_MODEL_ID")
DEFAULT_MODEL_DIR = "/tmp/sagemaker-tiered-kvcache/default-model"
DEFAULT_DOWNLOAD_DIR = os.path.join(tempfile.gettempdir(), "sagemaker-tiered-kvcache", "models")


@dataclass(frozen=True)
class ModelSource:
    source: str  # what named it: a variable, the SageMaker folder, or "default"
    model: str  # what vLLM gets as --model: hub id or local folder
    served_name: str  # the name clients send as "model" (and metrics carry)
    revision: Optional[str] = None
    local_dir: Optional[str] = None
    s3_uri: Optional[str] = None  # fetched into local_dir by fetch_model before vLLM starts


def sagemaker_model_dir(env: Mapping[str, str]) -> str:
    base = env.get("SAGEMAKER_BASE_DIR") or "/opt/ml"
    return os.path.join(base, "model")


def model_folder(path: str) -> Optional[str]:
    """``path`` if it holds ``config.json``, else its only sub-folder that does."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    try:
        subs = [e.path for e in os.scandir(path) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return None
    found = [s for s in subs if os.path.isfile(os.path.join(s, "config.json"))]
    return found[0] if len(found) == 1 else None


def resolve_model(env: Mapping[str, str]) -> ModelSource:
    """Which model to serve (module docstring); generates the default model if chosen."""
    revision = env.get("HF_MODEL_REVISION") or None
    for var in MODEL_VARIABLES:
        value = str(env.get(var) or "").strip()
        if value:
            return _named(var, value, revision, env)
    sm_dir = sagemaker_model_dir(env)
    found = model_folder(sm_dir)
    if found:
        return ModelSource(sm_dir, found, "model", local_dir=found)
    default = parse_bool(env, "SERVING_DEFAULT_MODEL", None)
    if default is None:
        default = not os.path.isdir(sm_dir)
    if not default:
        raise ConfigError(
            f"no model to serve: {sm_dir} holds no model (no config.json in it or in one folder "
            f"below it) and none of {', '.join(MODEL_VARIABLES)} is set. Ship the model as the "
            "model data (ModelDataUrl / ModelDataSource) or name it in HF_MODEL_ID; "
            "SERVING_DEFAULT_MODEL=true serves a small random test model instead"
        )
    from serving.default_model import ModelShape, ensure_model

    path = env.get("SERVING_DEFAULT_MODEL_DIR") or DEFAULT_MODEL_DIR
    try:
        ensure_model(path, ModelShape())
    except OSError as e:
        raise ConfigError(f"SERVING_DEFAULT_MODEL_DIR={path!r}: cannot write the default model there ({e})") from None
    return ModelSource("default", path, "default-model", local_dir=path)


def _named(var: str, value: str, revision: Optional[str], env: Mapping[str, str]) -> ModelSource:
    if value.startswith("s3://"):
        bucket, _, prefix = value[5:].partition("/")
        if not bucket:
            raise ConfigError(f"{var}={value!r} names no bucket")
        root = env.get("SERVING_DOWNLOAD_DIR") or DEFAULT_DOWNLOAD_DIR
        local = os.path.join(root, bucket, prefix.strip("/") or "_")
        return ModelSource(var, local, "model", None, local, value)
    if os.path.isdir(value):
        found = model_folder(value)
        if found is None:
            raise ConfigError(
                f"{var}={value!r} is a folder without a model (no config.json in it or in one folder below it)"
            )
        return ModelSource(var, found, value, revision, found)
    if value.startswith(("/", ".")) or value.count("/") > 1:
        raise ConfigError(
            f"{var}={value!r} is neither a folder here, an s3:// prefix, nor a Hugging Face hub id (org/name)"
        )
    return ModelSource(var, value, value, revision)


def hf_config(model: ModelSource, env: Mapping[str, str]) -> Optional[dict]:
    """The model's config.json (only that file is fetched for a hub or S3 model), or
    None (logged) when it cannot be had: tiers are then sized in bytes only."""
    try:
        if model.s3_uri:
            fetch_model(model, only=("config.json",))
        if model.local_dir:
            return load_hf_config(model.local_dir)
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(model.model, "config.json", revision=model.revision, token=env.get("HF_TOKEN") or None)
        return load_hf_config(path)
    except FootprintError as e:
        raise ConfigError(f"model {model.model}: {e}") from None
    except ConfigError:
        raise
    except Exception as e:  # offline, gated repo without token ...: size in bytes only
        log.warning("could not read config.json of %s (%s); tiers sized in bytes only", model.model, e)
        return None


def fetch_model(model: ModelSource, only: Optional[tuple[str, ...]] = None, client=None) -> int:
    """Download an S3 model's files into ``model.local_dir`` (those named in ``only``, if
    given); a file already there with the same size is kept, unless the object's ETag
    differs from the one it was downloaded with. A whole fetch records every file's ETag
    (``cache.weights.S3_MANIFEST``, in the fingerprint of the weights). Returns the files
    fetched. Blocks for as long as the download takes: call it from a thread."""
    if not model.s3_uri:
        return 0
    local_dir = model.local_dir
    if local_dir is None:
        raise ValueError(f"{model.s3_uri}: no local folder to download it into")
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = model.s3_uri[5:].partition("/")
    prefix = prefix.strip("/")
    s3 = client or boto3.client("s3")
    fetched = 0
    manifest_path = os.path.join(local_dir, S3_MANIFEST)
    try:
        with open(manifest_path) as f:
            etags = dict(json.load(f))
    except (OSError, ValueError, TypeError):
        etags = {}
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=(prefix + "/") if prefix else "")
        for page in pages:
            for obj in page.get("Contents", ()):
                rel = obj["Key"][len(prefix) :].lstrip("/") if prefix else obj["Key"]
                if not rel or rel.endswith("/") or (only and rel not in only):
                    continue
                target = os.path.join(local_dir, rel)
                known = etags.get(rel) or [obj["Size"], obj.get("ETag")]
                if os.path.isfile(target) and os.path.getsize(target) == obj["Size"] and known[1] == obj.get("ETag"):
                    etags[rel] = [obj["Size"], obj.get("ETag")]
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                partial = f"{target}.partial-{os.getpid()}"
                etags.pop(rel, None)
                s3.download_file(bucket, obj["Key"], partial)
                os.replace(partial, target)
                etags[rel] = [obj["Size"], obj.get("ETag")]
                fetched += 1
    except (BotoCoreError, ClientError) as e:
        raise ConfigError(f"cannot download the model from {model.s3_uri}: {e}") from None
    if not only:
        if not os.path.isfile(os.path.join(local_dir, "config.json")):
            raise ConfigError(f"{model.s3_uri} holds no config.json: not a model")
        with open(f"{manifest_path}.partial-{os.getpid()}", "w") as f:
            json.dump(etags, f)
        os.replace(f.name, manifest_path)
        log.info("model %s: %d file(s) downloaded to %s", model.s3_uri, fetched, model.local_dir)
    return fetched
