"""Deploy the image as a SageMaker real-time endpoint (boto3): model, endpoint config, endpoint.

Runs on an operator's machine or in CI, never in the container. The requests are built
by pure functions (``model_request`` ...) so tests check them against botocore's own
service model; ``deploy`` sends them.

    python deploy/sagemaker_endpoint.py --name llama3-8b-kv \
        --image 123456789012.dkr.ecr.us-east-1.amazonaws.com/sagemaker-tiered-kvcache:abc123-gpu \
        --role arn:aws:iam::123456789012:role/SageMakerExecution \
        --hf-model-id meta-llama/Meta-Llama-3-8B-Instruct --hf-token-env HF_TOKEN \
        --instance-type ml.g5.12xlarge --cpu-size 40% --disk-size 60% \
        [--remote-url curvine://kvcache/llama3-8b --curvine-conf /etc/curvine/curvine-cluster.toml] \
        [--routing prefix-aware] [--env SM_VLLM_MAX_MODEL_LEN=32768] [--dry-run] [--delete]

A second deploy of the same name creates a new model and endpoint config and updates the
endpoint in place (blue/green by SageMaker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# Model load (download + weights + warm-up) can take many minutes for large models.
DEFAULT_STARTUP_TIMEOUT_S = 1800
DEFAULT_DOWNLOAD_TIMEOUT_S = 1800
VARIANT = "AllTraffic"


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
    cpu_size: Optional[str] = None          # KVCACHE_CPU_SIZE (e.g. 40%, 64GiB)
    disk_size: Optional[str] = None         # KVCACHE_DISK_SIZE
    remote_url: Optional[str] = None        # KVCACHE_REMOTE_URL (Curvine)
    curvine_conf: Optional[str] = None      # KVCACHE_CURVINE_CONF
    stateful_sessions: bool = True
    routing: Optional[str] = None           # None, "least-outstanding", "random", "prefix-aware"
    prefix_length: int = 4096               # bytes/characters used by prefix-aware routing
    concurrency_threshold: int = 32
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    download_timeout_s: int = DEFAULT_DOWNLOAD_TIMEOUT_S
    volume_size_gb: Optional[int] = None    # only for instance types without local NVMe
    extra_env: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)

    @property
    def stamp(self) -> str:
        return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def environment(spec: EndpointSpec) -> dict[str, str]:
    """The container's environment: model, engine and tier settings (see README.md)."""
    env: dict[str, str] = {}
    if spec.hf_model_id:
        env["HF_MODEL_ID"] = spec.hf_model_id
    if spec.num_gpus:
        env["SM_NUM_GPUS"] = str(spec.num_gpus)
    for var, value in (("KVCACHE_CPU_SIZE", spec.cpu_size), ("KVCACHE_DISK_SIZE", spec.disk_size),
                       ("KVCACHE_REMOTE_URL", spec.remote_url),
                       ("KVCACHE_CURVINE_CONF", spec.curvine_conf)):
        if value:
            env[var] = value
    env["KVCACHE_DISK_PATH"] = "/tmp/kvcache"   # the big local volume (NVMe) on SageMaker hosts
    env["SAGEMAKER_ENABLE_STATEFUL_SESSIONS"] = "true" if spec.stateful_sessions else "false"
    env.update({k: str(v) for k, v in spec.extra_env.items()})
    for k, v in env.items():
        if len(v) > 1024:
            raise ValueError(f"environment value of {k} is over SageMaker's 1024 characters")
    if len(env) > 100:
        raise ValueError("SageMaker allows at most 100 environment variables")
    return env


def model_name(spec: EndpointSpec, stamp: str) -> str:
    return f"{spec.name}-{stamp}"[:63]


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
    if spec.tags:
        req["Tags"] = [{"Key": k, "Value": v} for k, v in spec.tags.items()]
    return req


_ROUTING = {"least-outstanding": "LEAST_OUTSTANDING_REQUESTS", "random": "RANDOM",
            "prefix-aware": "PREFIX_AWARE"}


def endpoint_config_request(spec: EndpointSpec, stamp: str) -> dict[str, Any]:
    variant: dict[str, Any] = {
        "VariantName": VARIANT,
        "ModelName": model_name(spec, stamp),
        "InstanceType": spec.instance_type,
        "InitialInstanceCount": spec.instance_count,
        "ContainerStartupHealthCheckTimeoutInSeconds": spec.startup_timeout_s,
        "ModelDataDownloadTimeoutInSeconds": spec.download_timeout_s,
    }
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
        req["Tags"] = [{"Key": k, "Value": v} for k, v in spec.tags.items()]
    return req


def _endpoint_exists(sm, name: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        sm.describe_endpoint(EndpointName=name)
        return True
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ValidationException":
            return False
        raise


def deploy(sm, spec: EndpointSpec, stamp: Optional[str] = None, wait: bool = True,
           log=print) -> str:
    """Create the model and endpoint config, then create or update the endpoint.
    Returns the endpoint ARN. ``sm`` is ``boto3.client("sagemaker")``."""
    stamp = stamp or spec.stamp
    sm.create_model(**model_request(spec, stamp))
    log(f"model {model_name(spec, stamp)} created")
    sm.create_endpoint_config(**endpoint_config_request(spec, stamp))
    log(f"endpoint config {model_name(spec, stamp)} created")
    config = model_name(spec, stamp)
    if _endpoint_exists(sm, spec.name):
        arn = sm.update_endpoint(EndpointName=spec.name, EndpointConfigName=config)["EndpointArn"]
        log(f"endpoint {spec.name} updating to {config}")
    else:
        req: dict[str, Any] = {"EndpointName": spec.name, "EndpointConfigName": config}
        if spec.tags:
            req["Tags"] = [{"Key": k, "Value": v} for k, v in spec.tags.items()]
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


def invoke(runtime, endpoint: str, body: dict, session_id: Optional[str] = None) -> tuple[dict, Optional[str]]:
    """One invocation (``boto3.client("sagemaker-runtime")``); returns the JSON answer and
    the session id (a new one when ``session_id="NEW_SESSION"``)."""
    kwargs: dict[str, Any] = {"EndpointName": endpoint, "ContentType": "application/json",
                              "Accept": "application/json", "Body": json.dumps(body)}
    if session_id:
        kwargs["SessionId"] = session_id
    resp = runtime.invoke_endpoint(**kwargs)
    new = resp.get("NewSessionId")
    sid = new.split(";")[0].strip() if new else session_id
    return json.loads(resp["Body"].read() or b"null"), sid


def _kv(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--env/--tag wants KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k] = v
    return out


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
    p.add_argument("--cpu-size")
    p.add_argument("--disk-size")
    p.add_argument("--remote-url")
    p.add_argument("--curvine-conf")
    p.add_argument("--no-sessions", action="store_true", help="turn stateful sessions off")
    p.add_argument("--routing", choices=sorted(_ROUTING))
    p.add_argument("--startup-timeout", type=int, default=DEFAULT_STARTUP_TIMEOUT_S)
    p.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for the container")
    p.add_argument("--tag", action="append", default=[], help="KEY=VALUE tag")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the requests, send nothing")
    p.add_argument("--delete", action="store_true", help="delete the endpoint, config and model")
    a = p.parse_args(argv)

    import boto3

    sm = boto3.client("sagemaker", region_name=a.region)
    if a.delete:
        delete(sm, a.name)
        return 0
    if not (a.image and a.role):
        p.error("--image and --role are required to deploy")
    extra = _kv(a.env)
    if a.hf_token_env:
        token = os.environ.get(a.hf_token_env)
        if not token:
            p.error(f"${a.hf_token_env} is empty")
        extra["HF_TOKEN"] = token
    spec = EndpointSpec(name=a.name, image_uri=a.image, role_arn=a.role, instance_type=a.instance_type,
                        instance_count=a.instance_count, hf_model_id=a.hf_model_id,
                        model_data_url=a.model_data, num_gpus=a.num_gpus, cpu_size=a.cpu_size,
                        disk_size=a.disk_size, remote_url=a.remote_url, curvine_conf=a.curvine_conf,
                        stateful_sessions=not a.no_sessions, routing=a.routing,
                        startup_timeout_s=a.startup_timeout, extra_env=extra, tags=_kv(a.tag))
    if a.dry_run:
        stamp = spec.stamp
        shown = {"CreateModel": model_request(spec, stamp),
                 "CreateEndpointConfig": endpoint_config_request(spec, stamp)}
        env = shown["CreateModel"]["PrimaryContainer"]["Environment"]
        if "HF_TOKEN" in env:
            env["HF_TOKEN"] = "***"
        print(json.dumps(shown, indent=2))
        return 0
    print(deploy(sm, spec, wait=not a.no_wait))
    return 0


if __name__ == "__main__":
    sys.exit(main())
