"""Deploy the image as a SageMaker real-time endpoint (boto3): model, endpoint config, endpoint.

Runs on an operator's machine or in CI, never in the container. The requests are built
by pure functions (``model_request`` ...) and checked against botocore's own service
model before anything is sent (``--dry-run`` prints them after that check); ``deploy``
sends them.

    python deploy/sagemaker_endpoint.py --name llama3-8b-kv \
        --image 123456789012.dkr.ecr.us-east-1.amazonaws.com/sagemaker-tiered-kvcache:abc123-gpu \
        --role arn:aws:iam::123456789012:role/SageMakerExecution \
        --hf-model-id meta-llama/Meta-Llama-3-8B-Instruct --hf-token-env HF_TOKEN \
        --instance-type ml.g5.12xlarge --dram-size 40% --disk-size 60% \
        [--shared-url curvine:///kvcache/llama3-8b --curvine-masters 10.0.1.10:8995,10.0.1.11:8995 \
         --signing-key-env KVCACHE_KEY --subnets subnet-0a1b,subnet-2c3d --security-groups sg-0e4f] \
        [--routing prefix-aware] [--env SM_VLLM_MAX_MODEL_LEN=32768] [--dry-run] [--delete]

A second deploy of the same name creates a new model and endpoint config and updates the
endpoint in place (blue/green by SageMaker).
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# Model load (download + weights + warm-up) can take many minutes for large models.
DEFAULT_STARTUP_TIMEOUT_S = 1800
DEFAULT_DOWNLOAD_TIMEOUT_S = 1800
VARIANT = "AllTraffic"
MODEL_DIR = "/opt/ml/model"   # where SageMaker puts ModelDataUrl / ModelDataSource
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
    model_data_url: Optional[str] = None    # s3://bucket/prefix/ (uncompressed) or .../model.tar.gz
    num_gpus: Optional[int] = None          # SM_NUM_GPUS; None: the container uses every GPU
    dram_size: Optional[str] = None         # KVCACHE_DRAM_SIZE (e.g. 40%, 64GiB)
    disk_size: Optional[str] = None         # KVCACHE_DISK_SIZE
    shared_url: Optional[str] = None        # KVCACHE_SHARED_URL (curvine:///folder)
    curvine_masters: Optional[str] = None   # KVCACHE_CURVINE_MASTERS (host:port,host:port)
    curvine_conf: Optional[str] = None      # KVCACHE_CURVINE_CONF: a file in the model data
    signing_key: Optional[str] = None       # KVCACHE_SIGNING_KEY
    subnets: tuple[str, ...] = ()           # VpcConfig: where the Curvine cluster is reachable
    security_group_ids: tuple[str, ...] = ()
    stateful_sessions: bool = True
    routing: Optional[str] = None           # None, "least-outstanding", "random", "prefix-aware"
    prefix_length: int = 4096               # bytes/characters used by prefix-aware routing
    concurrency_threshold: int = 32
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    download_timeout_s: int = DEFAULT_DOWNLOAD_TIMEOUT_S
    inference_ami_version: Optional[str] = "auto"   # "auto": GPU_INFERENCE_AMI on GPU instances
    volume_size_gb: Optional[int] = None    # only for instance types without local NVMe
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
        raise ValueError("--curvine-conf names a file in the model data, but there is no "
                         "--model-data; use --curvine-masters instead, or ship the file in the model")
    path = posixpath.normpath(spec.curvine_conf)
    if path.startswith("/"):
        if not path.startswith(MODEL_DIR + "/"):
            raise ValueError(f"--curvine-conf {spec.curvine_conf}: the container sees only the "
                             f"model data under {MODEL_DIR}; give a path inside it")
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
_OWN_ENV = {"HF_MODEL_ID": "--hf-model-id", "SM_NUM_GPUS": "--num-gpus",
            "KVCACHE_DRAM_SIZE": "--dram-size", "KVCACHE_DISK_SIZE": "--disk-size",
            "KVCACHE_SHARED_URL": "--shared-url", "KVCACHE_CURVINE_MASTERS": "--curvine-masters",
            "KVCACHE_CURVINE_CONF": "--curvine-conf", "KVCACHE_SIGNING_KEY": "--signing-key-env",
            "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "--no-sessions",
            "SAGEMAKER_STARTUP_TIMEOUT": "--startup-timeout"}


def environment(spec: EndpointSpec) -> dict[str, str]:
    """The container's environment: model, engine and tier settings (see README.md)."""
    clash = sorted(set(spec.extra_env) & set(_OWN_ENV))
    if clash:
        raise ValueError(f"--env {clash[0]}: set it with {_OWN_ENV[clash[0]]}")
    if spec.shared_url and not spec.signing_key:
        raise ValueError("a shared tier (--shared-url) needs a signing key (--signing-key-env): "
                         "nodes would otherwise load entries anyone with write access made")
    if (spec.shared_url or "").startswith("curvine:") and not (spec.curvine_masters or spec.curvine_conf):
        raise ValueError("--shared-url curvine://... needs --curvine-masters or --curvine-conf")
    env: dict[str, str] = {}
    for var, value in (("HF_MODEL_ID", spec.hf_model_id),
                       ("SM_NUM_GPUS", str(spec.num_gpus) if spec.num_gpus else None),
                       ("KVCACHE_DRAM_SIZE", spec.dram_size), ("KVCACHE_DISK_SIZE", spec.disk_size),
                       ("KVCACHE_SHARED_URL", spec.shared_url),
                       ("KVCACHE_CURVINE_MASTERS", spec.curvine_masters),
                       ("KVCACHE_CURVINE_CONF", curvine_conf_in_model(spec)),
                       ("KVCACHE_SIGNING_KEY", spec.signing_key)):
        if value:
            env[var] = value
    env["KVCACHE_DISK_PATH"] = "/tmp/kvcache"   # the big local volume (NVMe) on SageMaker hosts
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


def _tags(spec: EndpointSpec) -> list[dict[str, str]]:
    return [{"Key": k, "Value": v} for k, v in spec.tags.items()]


def model_request(spec: EndpointSpec, stamp: str) -> dict[str, Any]:
    container: dict[str, Any] = {"Image": spec.image_uri, "Environment": environment(spec)}
    if spec.model_data_url:
        if spec.model_data_url.endswith(".tar.gz"):
            container["ModelDataUrl"] = spec.model_data_url
        else:  # an uncompressed prefix: SageMaker copies it to /opt/ml/model as is
            container["ModelDataSource"] = {"S3DataSource": {
                "S3Uri": spec.model_data_url.rstrip("/") + "/",
                "S3DataType": "S3Prefix", "CompressionType": "None"}}
    req: dict[str, Any] = {"ModelName": model_name(spec, stamp), "PrimaryContainer": container,
                           "ExecutionRoleArn": spec.role_arn}
    if spec.subnets or spec.security_group_ids:
        if not (spec.subnets and spec.security_group_ids):
            raise ValueError("a VPC needs both --subnets and --security-groups")
        req["VpcConfig"] = {"Subnets": list(spec.subnets),
                            "SecurityGroupIds": list(spec.security_group_ids)}
    if spec.tags:
        req["Tags"] = _tags(spec)
    return req


_ROUTING = {"least-outstanding": "LEAST_OUTSTANDING_REQUESTS", "random": "RANDOM",
            "prefix-aware": "PREFIX_AWARE"}


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
        if spec.routing not in _ROUTING:
            raise ValueError(f"routing {spec.routing!r}: choose one of {sorted(_ROUTING)}")
        routing: dict[str, Any] = {"RoutingStrategy": _ROUTING[spec.routing]}
        if spec.routing == "prefix-aware":
            routing["PrefixAwareRoutingConfig"] = {"PrefixLength": spec.prefix_length,
                                                   "ConcurrencyThreshold": spec.concurrency_threshold}
        variant["RoutingConfig"] = routing
    req: dict[str, Any] = {"EndpointConfigName": model_name(spec, stamp), "ProductionVariants": [variant]}
    if spec.tags:
        req["Tags"] = _tags(spec)
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
    size = value if shape.type_name in ("integer", "long") else len(value) if shape.type_name in (
        "string", "list", "map") else None
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


def _endpoint_exists(sm, name: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        sm.describe_endpoint(EndpointName=name)
        return True
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ValidationException":
            return False
        raise


def _check_model_file(s3, head: dict[str, str]) -> None:
    from botocore.exceptions import ClientError

    try:
        s3.head_object(**head)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            raise ValueError(f"--curvine-conf: s3://{head['Bucket']}/{head['Key']} does not exist "
                             "in the model data") from None
        raise


def deploy(sm, spec: EndpointSpec, stamp: Optional[str] = None, wait: bool = True,
           log=print, s3=None) -> str:
    """Create the model and endpoint config, then create or update the endpoint.
    Returns the endpoint ARN. ``sm`` is ``boto3.client("sagemaker")``; ``s3`` (for the
    ``--curvine-conf`` check) is made from ``sm``'s session when needed."""
    stamp = stamp or spec.stamp
    built = requests(spec, stamp)
    if "HeadObject" in built:
        if s3 is None:
            import boto3
            s3 = boto3.client("s3", region_name=sm.meta.region_name)
        _check_model_file(s3, built["HeadObject"][1])
    elif spec.curvine_conf:
        log(f"note: {spec.curvine_conf} is not checked inside the tarball {spec.model_data_url}")
    sm.create_model(**built["CreateModel"][1])
    log(f"model {model_name(spec, stamp)} created")
    sm.create_endpoint_config(**built["CreateEndpointConfig"][1])
    log(f"endpoint config {model_name(spec, stamp)} created")
    config = model_name(spec, stamp)
    if _endpoint_exists(sm, spec.name):
        arn = sm.update_endpoint(EndpointName=spec.name, EndpointConfigName=config)["EndpointArn"]
        log(f"endpoint {spec.name} updating to {config}")
    else:
        req: dict[str, Any] = {"EndpointName": spec.name, "EndpointConfigName": config}
        if spec.tags:
            req["Tags"] = _tags(spec)
        arn = sm.create_endpoint(**req)["EndpointArn"]
        log(f"endpoint {spec.name} creating")
    if wait:
        log("waiting for InService (model download and load included) ...")
        sm.get_waiter("endpoint_in_service").wait(
            EndpointName=spec.name, WaiterConfig={"Delay": 30, "MaxAttempts": 120})
        log(f"endpoint {spec.name} is InService")
    return arn


def delete(sm, name: str, log=print) -> None:
    """Delete the endpoint, its config and its model."""
    desc = sm.describe_endpoint(EndpointName=name)
    config = desc["EndpointConfigName"]
    models = [v["ModelName"] for v in
              sm.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"]]
    sm.delete_endpoint(EndpointName=name)
    sm.delete_endpoint_config(EndpointConfigName=config)
    for m in models:
        sm.delete_model(ModelName=m)
    log(f"deleted endpoint {name}, config {config}, models {', '.join(models)}")


def invoke(runtime, endpoint: str, body: dict, session_id: Optional[str] = None,
           prefix_aware_id: Optional[str] = None) -> tuple[Any, Optional[str]]:
    """One invocation (``boto3.client("sagemaker-runtime")``); returns the JSON answer and
    the session to use next.

    ``session_id="NEW_SESSION"`` opens a stateful session: SageMaker answers with
    ``NewSessionId`` ("<id>; Expires=<time>") and the id is returned; an existing id is
    returned as is, or None once the answer carries ``ClosedSessionId``.
    ``prefix_aware_id`` is the routing hint of prefix-aware routing (``PrefixAwareId``):
    requests with the same hint and prefix go to the same instance."""
    kwargs: dict[str, Any] = {"EndpointName": endpoint, "ContentType": "application/json",
                              "Accept": "application/json", "Body": json.dumps(body)}
    if session_id:
        kwargs["SessionId"] = session_id
    if prefix_aware_id:
        kwargs["PrefixAwareId"] = prefix_aware_id
    resp = runtime.invoke_endpoint(**kwargs)
    if resp.get("NewSessionId"):
        session_id = resp["NewSessionId"].split(";")[0].strip()
    elif resp.get("ClosedSessionId"):
        session_id = None
    elif session_id == "NEW_SESSION":
        session_id = None   # the container opened no session
    return json.loads(resp["Body"].read() or b"null"), session_id


def _kv(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--env/--tag wants KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def _csv(text: Optional[str]) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def _secret(p: argparse.ArgumentParser, var: Optional[str]) -> Optional[str]:
    if not var:
        return None
    value = os.environ.get(var)
    if not value:
        p.error(f"${var} is empty")
    return value


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True, help="endpoint name")
    p.add_argument("--image", help="image URI in ECR")
    p.add_argument("--role", help="SageMaker execution role ARN")
    p.add_argument("--region", default=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"))
    p.add_argument("--instance-type", default=EndpointSpec.instance_type)
    p.add_argument("--instance-count", type=int, default=1)
    p.add_argument("--hf-model-id")
    p.add_argument("--hf-token-env", help="name of a local variable holding the HF token to pass on")
    p.add_argument("--model-data", help="s3:// prefix or model.tar.gz, mounted at /opt/ml/model")
    p.add_argument("--num-gpus", type=int)
    p.add_argument("--dram-size", help="KVCACHE_DRAM_SIZE")
    p.add_argument("--disk-size", help="KVCACHE_DISK_SIZE")
    p.add_argument("--shared-url", help="KVCACHE_SHARED_URL, e.g. curvine:///kvcache/<model>")
    p.add_argument("--curvine-masters", help="KVCACHE_CURVINE_MASTERS: host:port,host:port")
    p.add_argument("--curvine-conf", help="a Curvine client file inside --model-data "
                   "(relative to it, or under /opt/ml/model)")
    p.add_argument("--signing-key-env", help="name of a local variable holding KVCACHE_SIGNING_KEY")
    p.add_argument("--subnets", help="VpcConfig subnets, comma-separated")
    p.add_argument("--security-groups", help="VpcConfig security group ids, comma-separated")
    p.add_argument("--no-sessions", action="store_true", help="turn stateful sessions off")
    p.add_argument("--routing", choices=sorted(_ROUTING))
    p.add_argument("--startup-timeout", type=int, default=DEFAULT_STARTUP_TIMEOUT_S,
                   help="ContainerStartupHealthCheckTimeoutInSeconds and SAGEMAKER_STARTUP_TIMEOUT")
    p.add_argument("--inference-ami-version", default="auto",
                   help=f"host AMI (default on GPU instances: {GPU_INFERENCE_AMI}, CUDA 13.0)")
    p.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for the container")
    p.add_argument("--tag", action="append", default=[], help="KEY=VALUE tag")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print the requests (secrets masked), send nothing")
    p.add_argument("--delete", action="store_true", help="delete the endpoint, config and model")
    a = p.parse_args(argv)

    from botocore.exceptions import ParamValidationError

    if a.delete:
        import boto3
        delete(boto3.client("sagemaker", region_name=a.region), a.name)
        return 0
    if not (a.image and a.role):
        p.error("--image and --role are required to deploy")
    extra = _kv(a.env)
    secrets = {"HF_TOKEN": _secret(p, a.hf_token_env)}
    if secrets["HF_TOKEN"]:
        extra["HF_TOKEN"] = secrets["HF_TOKEN"]
    try:
        spec = EndpointSpec(
            name=a.name, image_uri=a.image, role_arn=a.role, instance_type=a.instance_type,
            instance_count=a.instance_count, hf_model_id=a.hf_model_id, model_data_url=a.model_data,
            num_gpus=a.num_gpus, dram_size=a.dram_size, disk_size=a.disk_size,
            shared_url=a.shared_url, curvine_masters=a.curvine_masters, curvine_conf=a.curvine_conf,
            signing_key=_secret(p, a.signing_key_env), subnets=_csv(a.subnets),
            security_group_ids=_csv(a.security_groups), stateful_sessions=not a.no_sessions,
            routing=a.routing, startup_timeout_s=a.startup_timeout,
            inference_ami_version=None if a.inference_ami_version == "none" else a.inference_ami_version,
            extra_env=extra, tags=_kv(a.tag))
        built = requests(spec, spec.stamp)
    except (ValueError, ParamValidationError) as e:
        p.error(str(e))
    if a.dry_run:
        shown = {op: params for op, (_, params) in built.items()}
        env = shown["CreateModel"]["PrimaryContainer"]["Environment"]
        for var in ("HF_TOKEN", "KVCACHE_SIGNING_KEY"):
            if var in env:
                env[var] = "***"
        print(json.dumps(shown, indent=2))
        return 0
    import boto3
    print(deploy(boto3.client("sagemaker", region_name=a.region), spec, wait=not a.no_wait))
    return 0


if __name__ == "__main__":
    sys.exit(main())
