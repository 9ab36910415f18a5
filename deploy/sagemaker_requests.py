"""The SageMaker requests that deploy this image, built by pure functions from one
``EndpointSpec`` and checked against botocore's own service models without calling AWS.

Runs on an operator's machine or in CI, never in the container; ``sagemaker_endpoint.py``
(the command line) sends what ``requests`` returns.
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# Model load (download + weights + warm-up) can take many minutes for large models.
DEFAULT_STARTUP_TIMEOUT_S = 1800
DEFAULT_DOWNLOAD_TIMEOUT_S = 1800
VARIANT = "AllTraffic"
MODEL_DIR = "/opt/ml/model"  # where SageMaker puts ModelDataUrl / ModelDataSource
# The GPU image is vllm/vllm-openai:v0.32.0: vllm 0.32.0 pins torch==2.13.0, whose Linux
# wheels are CUDA 13.0 builds. CUDA 13.0 needs NVIDIA driver 580, which only this host AMI
# has (botocore's ProductionVariant.InferenceAmiVersion: driver 580, CUDA 13.0); the
# default AMIs carry driver 535/550 (CUDA 12.2/12.4).
IMAGE_CUDA = (13, 0)
GPU_INFERENCE_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"


@dataclass(frozen=True)
class EndpointSpec:
    name: str
    image_uri: str
    role_arn: str
    instance_type: str = "ml.g5.12xlarge"
    instance_count: int = 1
    hf_model_id: Optional[str] = None
    model_data_url: Optional[str] = None  # s3://bucket/prefix/ (uncompressed) or .../model.tar.gz
    num_gpus: Optional[int] = None  # SM_NUM_GPUS; None: the container uses every GPU
    dram_size: Optional[str] = None  # KVCACHE_DRAM_SIZE (e.g. 40%, 64GiB)
    disk_size: Optional[str] = None  # KVCACHE_DISK_SIZE
    shared_url: Optional[str] = None  # KVCACHE_SHARED_URL (curvine:///folder)
    curvine_masters: Optional[str] = None  # KVCACHE_CURVINE_MASTERS (host:port,host:port)
    curvine_conf: Optional[str] = None  # KVCACHE_CURVINE_CONF: a file in the model data
    signing_key: Optional[str] = None  # KVCACHE_SIGNING_KEY
    subnets: tuple[str, ...] = ()  # VpcConfig: where the Curvine cluster is reachable
    security_group_ids: tuple[str, ...] = ()
    stateful_sessions: bool = True
    routing: Optional[str] = None  # None, "least-outstanding", "random", "prefix-aware"
    prefix_length: int = 4096  # bytes/characters used by prefix-aware routing
    concurrency_threshold: int = 32
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    download_timeout_s: int = DEFAULT_DOWNLOAD_TIMEOUT_S
    inference_ami_version: Optional[str] = "auto"  # "auto": GPU_INFERENCE_AMI on GPU instances
    volume_size_gb: Optional[int] = None  # only for instance types without local NVMe
    extra_env: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)

    @property
    def stamp(self) -> str:
        return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def curvine_conf_in_model(spec: EndpointSpec) -> Optional[str]:
    """``--curvine-conf`` as a path relative to the model folder, after checking that it
    can be there: the container sees only the model data (``/opt/ml/model``) besides the
    image, so the file must be part of ``--model-data``."""
    if not spec.curvine_conf:
        return None
    if not spec.model_data_url:
        raise ValueError(
            "--curvine-conf names a file in the model data, but there is no "
            "--model-data; use --curvine-masters instead, or ship the file in the model"
        )
    path = posixpath.normpath(spec.curvine_conf)
    if path.startswith("/"):
        if not path.startswith(MODEL_DIR + "/"):
            raise ValueError(
                f"--curvine-conf {spec.curvine_conf}: the container sees only the "
                f"model data under {MODEL_DIR}; give a path inside it"
            )
        path = posixpath.relpath(path, MODEL_DIR)
    if path == "." or path.startswith("../"):
        raise ValueError(f"--curvine-conf {spec.curvine_conf} is not a file inside the model data")
    return path


def model_file_request(spec: EndpointSpec) -> Optional[dict[str, str]]:
    """S3 HeadObject that proves ``--curvine-conf`` is in an uncompressed ``--model-data``
    prefix (None when there is nothing to check, or for a tarball, which is not opened)."""
    rel = curvine_conf_in_model(spec)
    if rel is None or spec.model_data_url.endswith(".tar.gz"):
        return None
    bucket, _, prefix = spec.model_data_url.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    return {"Bucket": bucket, "Key": f"{prefix}/{rel}" if prefix else rel}


# Variables the script sets from its own options: --env may not set them behind its back.
_OWN_ENV = {
    "HF_MODEL_ID": "--hf-model-id",
    "SM_NUM_GPUS": "--num-gpus",
    "KVCACHE_DRAM_SIZE": "--dram-size",
    "KVCACHE_DISK_SIZE": "--disk-size",
    "KVCACHE_SHARED_URL": "--shared-url",
    "KVCACHE_CURVINE_MASTERS": "--curvine-masters",
    "KVCACHE_CURVINE_CONF": "--curvine-conf",
    "KVCACHE_SIGNING_KEY": "--signing-key-env",
    "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "--no-sessions",
    "SAGEMAKER_STARTUP_TIMEOUT": "--startup-timeout",
}


def environment(spec: EndpointSpec) -> dict[str, str]:
    """The container's environment: model, engine and tier settings (see docs/settings.md)."""
    clash = sorted(set(spec.extra_env) & set(_OWN_ENV))
    if clash:
        raise ValueError(f"--env {clash[0]}: set it with {_OWN_ENV[clash[0]]}")
    if spec.shared_url and not spec.signing_key:
        raise ValueError(
            "a shared tier (--shared-url) needs a signing key (--signing-key-env): "
            "nodes would otherwise load entries anyone with write access made"
        )
    if (spec.shared_url or "").startswith("curvine:") and not (spec.curvine_masters or spec.curvine_conf):
        raise ValueError("--shared-url curvine://... needs --curvine-masters or --curvine-conf")
    env: dict[str, str] = {}
    for var, value in (
        ("HF_MODEL_ID", spec.hf_model_id),
        ("SM_NUM_GPUS", str(spec.num_gpus) if spec.num_gpus else None),
        ("KVCACHE_DRAM_SIZE", spec.dram_size),
        ("KVCACHE_DISK_SIZE", spec.disk_size),
        ("KVCACHE_SHARED_URL", spec.shared_url),
        ("KVCACHE_CURVINE_MASTERS", spec.curvine_masters),
        ("KVCACHE_CURVINE_CONF", curvine_conf_in_model(spec)),
        ("KVCACHE_SIGNING_KEY", spec.signing_key),
    ):
        if value:
            env[var] = value
    env["KVCACHE_DISK_PATH"] = "/tmp/kvcache"  # the big local volume (NVMe) on SageMaker hosts
    env["SAGEMAKER_ENABLE_STATEFUL_SESSIONS"] = "true" if spec.stateful_sessions else "false"
    # The container waits for its engine exactly as long as SageMaker waits for /ping.
    env["SAGEMAKER_STARTUP_TIMEOUT"] = str(spec.startup_timeout_s)
    env.update({k: str(v) for k, v in spec.extra_env.items()})
    for k, v in env.items():
        if len(v) > 1024:
            raise ValueError(f"environment value of {k} is over SageMaker's 1024 characters")
    if len(env) > 100:
        raise ValueError("SageMaker allows at most 100 environment variables")
    return env


def model_name(spec: EndpointSpec, stamp: str) -> str:
    return f"{spec.name}-{stamp}"[:63]


def tag_list(spec: EndpointSpec) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in spec.tags.items()]


def model_request(spec: EndpointSpec, stamp: str) -> dict[str, Any]:
    container: dict[str, Any] = {"Image": spec.image_uri, "Environment": environment(spec)}
    if spec.model_data_url:
        if spec.model_data_url.endswith(".tar.gz"):
            container["ModelDataUrl"] = spec.model_data_url
        else:  # an uncompressed prefix: SageMaker copies it to /opt/ml/model as is
            container["ModelDataSource"] = {
                "S3DataSource": {
                    "S3Uri": spec.model_data_url.rstrip("/") + "/",
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                }
            }
    req: dict[str, Any] = {
        "ModelName": model_name(spec, stamp),
        "PrimaryContainer": container,
        "ExecutionRoleArn": spec.role_arn,
    }
    if spec.subnets or spec.security_group_ids:
        if not (spec.subnets and spec.security_group_ids):
            raise ValueError("a VPC needs both --subnets and --security-groups")
        req["VpcConfig"] = {"Subnets": list(spec.subnets), "SecurityGroupIds": list(spec.security_group_ids)}
    if spec.tags:
        req["Tags"] = tag_list(spec)
    return req


ROUTING = {"least-outstanding": "LEAST_OUTSTANDING_REQUESTS", "random": "RANDOM", "prefix-aware": "PREFIX_AWARE"}


def inference_ami(spec: EndpointSpec) -> Optional[str]:
    """The host AMI: on GPU instances (ml.g*, ml.p*) one whose driver runs the image's CUDA."""
    if spec.inference_ami_version != "auto":
        return spec.inference_ami_version
    family = spec.instance_type.removeprefix("ml.")[:1]
    return GPU_INFERENCE_AMI if family in ("g", "p") else None


def endpoint_config_request(spec: EndpointSpec, stamp: str) -> dict[str, Any]:
    variant: dict[str, Any] = {
        "VariantName": VARIANT,
        "ModelName": model_name(spec, stamp),
        "InstanceType": spec.instance_type,
        "InitialInstanceCount": spec.instance_count,
        "ContainerStartupHealthCheckTimeoutInSeconds": spec.startup_timeout_s,
        "ModelDataDownloadTimeoutInSeconds": spec.download_timeout_s,
    }
    ami = inference_ami(spec)
    if ami:
        variant["InferenceAmiVersion"] = ami
    if spec.volume_size_gb:
        variant["VolumeSizeInGB"] = spec.volume_size_gb
    if spec.routing:
        if spec.routing not in ROUTING:
            raise ValueError(f"routing {spec.routing!r}: choose one of {sorted(ROUTING)}")
        routing: dict[str, Any] = {"RoutingStrategy": ROUTING[spec.routing]}
        if spec.routing == "prefix-aware":
            routing["PrefixAwareRoutingConfig"] = {
                "PrefixLength": spec.prefix_length,
                "ConcurrencyThreshold": spec.concurrency_threshold,
            }
        variant["RoutingConfig"] = routing
    req: dict[str, Any] = {"EndpointConfigName": model_name(spec, stamp), "ProductionVariants": [variant]}
    if spec.tags:
        req["Tags"] = tag_list(spec)
    return req


def validate_request(service: str, operation: str, params: Mapping[str, Any]) -> None:
    """Check ``params`` against botocore's service model without calling AWS: botocore's own
    parameter validation (types, required members, minimums), then the maximums and enums
    it leaves to the service. Raises ``botocore.exceptions.ParamValidationError``."""
    import botocore.session
    from botocore.exceptions import ParamValidationError
    from botocore.validate import validate_parameters

    shape = botocore.session.get_session().get_service_model(service).operation_model(operation).input_shape
    validate_parameters(params, shape)
    errors = list(_beyond_botocore(params, shape, operation))
    if errors:
        raise ParamValidationError(report="\n".join(errors))


def _beyond_botocore(value: Any, shape, path: str):
    if shape.type_name == "structure":
        for name, member in shape.members.items():
            if name in value:
                yield from _beyond_botocore(value[name], member, f"{path}.{name}")
        return
    if shape.type_name == "list":
        for i, item in enumerate(value):
            yield from _beyond_botocore(item, shape.member, f"{path}[{i}]")
    high = shape.metadata.get("max")
    size = (
        value
        if shape.type_name in ("integer", "long")
        else len(value)
        if shape.type_name in ("string", "list", "map")
        else None
    )
    if high is not None and size is not None and size > high:
        yield f"{path}: {size} is over the service's maximum {high}"
    if getattr(shape, "enum", None) and value not in shape.enum:
        yield f"{path}: {value!r} is not one of {shape.enum}"


def requests(spec: EndpointSpec, stamp: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every request a deploy sends, by operation name, as (service, params), each
    validated against botocore's model."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    head = model_file_request(spec)
    if head:
        out["HeadObject"] = ("s3", head)
    out["CreateModel"] = ("sagemaker", model_request(spec, stamp))
    out["CreateEndpointConfig"] = ("sagemaker", endpoint_config_request(spec, stamp))
    for operation, (service, params) in out.items():
        validate_request(service, operation, params)
    return out
