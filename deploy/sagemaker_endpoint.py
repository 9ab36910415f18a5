"""Deploy the image as a SageMaker real-time endpoint (boto3): model, endpoint config, endpoint.

Runs on an operator's machine or in CI, never in the container. The requests are built
and checked against botocore's own service models by ``sagemaker_requests.py`` before
anything is sent (``--dry-run`` prints them after that check); ``deploy`` sends them.

    python deploy/sagemaker_endpoint.py --name llama3-8b-kv \
        --image 123456789012.dkr.ecr.us-east-1.amazonaws.com/sagemaker-tiered-kvcache:abc123-gpu \
        --role arn:aws:iam::123456789012:role/SageMakerExecution \
        --hf-model-id meta-llama/Meta-Llama-3-8B-Instruct --hf-token-env HF_TOKEN \
        --instance-type ml.g5.12xlarge --dram-size 40% --disk-size 60% \
        [--shared-url curvine:///kvcache/llama3-8b --curvine-masters 10.0.1.10:8995,10.0.1.11:8995 \
         --signing-key-env KV_SIGNING_SECRET --subnets subnet-0a1b,subnet-2c3d --security-groups sg-0e4f] \
        [--routing prefix-aware] [--env SM_VLLM_MAX_MODEL_LEN=32768] [--dry-run] [--delete]

A second deploy of the same name creates a new model and endpoint config and updates the
endpoint in place (blue/green by SageMaker).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from sagemaker_requests import (
    DEFAULT_STARTUP_TIMEOUT_S,
    GPU_INFERENCE_AMI,
    ROUTING,
    EndpointSpec,
    model_name,
    requests,
    tag_list,
)


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
            raise ValueError(
                f"--curvine-conf: s3://{head['Bucket']}/{head['Key']} does not exist in the model data"
            ) from None
        raise


def deploy(sm, spec: EndpointSpec, stamp: Optional[str] = None, wait: bool = True, log=print, s3=None) -> str:
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
            req["Tags"] = tag_list(spec)
        arn = sm.create_endpoint(**req)["EndpointArn"]
        log(f"endpoint {spec.name} creating")
    if wait:
        log("waiting for InService (model download and load included) ...")
        sm.get_waiter("endpoint_in_service").wait(
            EndpointName=spec.name, WaiterConfig={"Delay": 30, "MaxAttempts": 120}
        )
        log(f"endpoint {spec.name} is InService")
    return arn


def delete(sm, name: str, log=print) -> None:
    """Delete the endpoint, its config and its model."""
    desc = sm.describe_endpoint(EndpointName=name)
    config = desc["EndpointConfigName"]
    models = [v["ModelName"] for v in sm.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"]]
    sm.delete_endpoint(EndpointName=name)
    sm.delete_endpoint_config(EndpointConfigName=config)
    for m in models:
        sm.delete_model(ModelName=m)
    log(f"deleted endpoint {name}, config {config}, models {', '.join(models)}")


def invoke(
    runtime, endpoint: str, body: dict, session_id: Optional[str] = None, prefix_aware_id: Optional[str] = None
) -> tuple[Any, Optional[str]]:
    """One invocation (``boto3.client("sagemaker-runtime")``); returns the answer (JSON,
    or the text of a non-JSON answer) and the session to use next.

    ``session_id="NEW_SESSION"`` opens a stateful session first (the container's session
    request, ``{"requestType": "NEW_SESSION"}``; SageMaker answers ``NewSessionId``,
    "<id>; Expires=<time>"), then sends ``body`` in it and returns the new id. An existing
    id is passed on and returned as is, or None once the answer carries ``ClosedSessionId``.
    ``prefix_aware_id`` is the routing hint of prefix-aware routing (``PrefixAwareId``):
    requests with the same hint and prefix go to the same instance."""
    base: dict[str, Any] = {"EndpointName": endpoint, "ContentType": "application/json", "Accept": "application/json"}
    if prefix_aware_id:
        base["PrefixAwareId"] = prefix_aware_id
    if session_id == "NEW_SESSION" and "requestType" not in body:
        opened = runtime.invoke_endpoint(
            **base, Body=json.dumps({"requestType": "NEW_SESSION"}), SessionId="NEW_SESSION"
        )
        if not opened.get("NewSessionId"):
            raise RuntimeError(f"endpoint {endpoint} opened no session (are stateful sessions on?)")
        session_id = opened["NewSessionId"].split(";")[0].strip()
    kwargs = {**base, "Body": json.dumps(body)}
    if session_id:
        kwargs["SessionId"] = session_id
    resp = runtime.invoke_endpoint(**kwargs)
    if resp.get("NewSessionId"):
        session_id = resp["NewSessionId"].split(";")[0].strip()
    elif resp.get("ClosedSessionId"):
        session_id = None
    raw = resp["Body"].read()
    try:
        answer = json.loads(raw) if raw else None
    except ValueError:  # session create/close answers are plain text
        answer = raw.decode("utf-8", "replace")
    return answer, session_id


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
    p.add_argument(
        "--curvine-conf", help="a Curvine client file inside --model-data (relative to it, or under /opt/ml/model)"
    )
    p.add_argument("--signing-key-env", help="name of a local variable holding KVCACHE_SIGNING_KEY")
    p.add_argument("--subnets", help="VpcConfig subnets, comma-separated")
    p.add_argument("--security-groups", help="VpcConfig security group ids, comma-separated")
    p.add_argument("--no-sessions", action="store_true", help="turn stateful sessions off")
    p.add_argument("--routing", choices=sorted(ROUTING))
    p.add_argument(
        "--startup-timeout",
        type=int,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help="ContainerStartupHealthCheckTimeoutInSeconds and SAGEMAKER_STARTUP_TIMEOUT",
    )
    p.add_argument(
        "--inference-ami-version",
        default="auto",
        help=f"host AMI (default on GPU instances: {GPU_INFERENCE_AMI}, CUDA 13.0)",
    )
    p.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for the container")
    p.add_argument("--tag", action="append", default=[], help="KEY=VALUE tag")
    p.add_argument("--no-wait", action="store_true")
    p.add_argument(
        "--dry-run", action="store_true", help="validate and print the requests (secrets masked), send nothing"
    )
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
            name=a.name,
            image_uri=a.image,
            role_arn=a.role,
            instance_type=a.instance_type,
            instance_count=a.instance_count,
            hf_model_id=a.hf_model_id,
            model_data_url=a.model_data,
            num_gpus=a.num_gpus,
            dram_size=a.dram_size,
            disk_size=a.disk_size,
            shared_url=a.shared_url,
            curvine_masters=a.curvine_masters,
            curvine_conf=a.curvine_conf,
            signing_key=_secret(p, a.signing_key_env),
            subnets=_csv(a.subnets),
            security_group_ids=_csv(a.security_groups),
            stateful_sessions=not a.no_sessions,
            routing=a.routing,
            startup_timeout_s=a.startup_timeout,
            inference_ami_version=None if a.inference_ami_version == "none" else a.inference_ami_version,
            extra_env=extra,
            tags=_kv(a.tag),
        )
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
