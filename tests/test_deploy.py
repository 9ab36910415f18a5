"""deploy/sagemaker_endpoint.py against botocore's own SageMaker service model (Stubber)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import boto3
import pytest
import yaml
from botocore.exceptions import ParamValidationError
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("sagemaker_endpoint", REPO / "deploy" / "sagemaker_endpoint.py")
dep = importlib.util.module_from_spec(_spec)
sys.modules["sagemaker_endpoint"] = dep  # dataclasses look their module up
_spec.loader.exec_module(dep)

ARN = "arn:aws:sagemaker:us-east-1:123456789012:endpoint/kv"
SPEC = dep.EndpointSpec(
    name="llama3-kv", image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/sagemaker-tiered-kvcache:abc-gpu",
    role_arn="arn:aws:iam::123456789012:role/SageMakerExecution", instance_type="ml.g5.12xlarge",
    hf_model_id="meta-llama/Meta-Llama-3-8B-Instruct", num_gpus=4, cpu_size="40%", disk_size="60%",
    remote_url="curvine://kvcache/llama3", curvine_conf="/etc/curvine/curvine-cluster.toml",
    routing="prefix-aware", extra_env={"SM_VLLM_MAX_MODEL_LEN": "32768"}, tags={"team": "ml"})
STAMP = "20260101-000000"


@pytest.fixture
def sm():
    client = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    with Stubber(client) as stub:
        yield client, stub
        stub.assert_no_pending_responses()


def test_requests_carry_the_tier_settings_and_startup_timeout():
    model = dep.model_request(SPEC, STAMP)
    env = model["PrimaryContainer"]["Environment"]
    assert env["HF_MODEL_ID"] == "meta-llama/Meta-Llama-3-8B-Instruct" and env["SM_NUM_GPUS"] == "4"
    assert env["KVCACHE_CPU_SIZE"] == "40%" and env["KVCACHE_DISK_SIZE"] == "60%"
    assert env["KVCACHE_DISK_PATH"] == "/tmp/kvcache"
    assert env["KVCACHE_REMOTE_URL"] == "curvine://kvcache/llama3"
    assert env["SAGEMAKER_ENABLE_STATEFUL_SESSIONS"] == "true"
    assert env["SM_VLLM_MAX_MODEL_LEN"] == "32768"
    variant = dep.endpoint_config_request(SPEC, STAMP)["ProductionVariants"][0]
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] >= 1200
    assert variant["ModelName"] == model["ModelName"] == f"llama3-kv-{STAMP}"
    assert variant["RoutingConfig"]["RoutingStrategy"] == "PREFIX_AWARE"


def test_deploy_creates_model_config_and_endpoint(sm):
    client, stub = sm
    stub.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"},
                      dep.model_request(SPEC, STAMP))
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c"},
                      dep.endpoint_config_request(SPEC, STAMP))
    stub.add_client_error("describe_endpoint", "ValidationException", "Could not find endpoint",
                          expected_params={"EndpointName": "llama3-kv"})
    stub.add_response("create_endpoint", {"EndpointArn": ARN},
                      {"EndpointName": "llama3-kv", "EndpointConfigName": f"llama3-kv-{STAMP}",
                       "Tags": [{"Key": "team", "Value": "ml"}]})
    assert dep.deploy(client, SPEC, stamp=STAMP, wait=False, log=lambda *_: None) == ARN


def test_redeploy_updates_in_place_and_waits(sm):
    client, stub = sm
    stub.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"},
                      {"ModelName": ANY, "PrimaryContainer": ANY, "ExecutionRoleArn": ANY, "Tags": ANY})
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c"},
                      {"EndpointConfigName": ANY, "ProductionVariants": ANY, "Tags": ANY})
    described = {"EndpointName": "llama3-kv", "EndpointArn": ARN, "EndpointConfigName": "old",
                 "EndpointStatus": "InService", "CreationTime": "2026-01-01T00:00:00Z",
                 "LastModifiedTime": "2026-01-01T00:00:00Z"}
    stub.add_response("describe_endpoint", described, {"EndpointName": "llama3-kv"})
    stub.add_response("update_endpoint", {"EndpointArn": ARN},
                      {"EndpointName": "llama3-kv", "EndpointConfigName": f"llama3-kv-{STAMP}"})
    stub.add_response("describe_endpoint", described, {"EndpointName": "llama3-kv"})  # the waiter
    assert dep.deploy(client, SPEC, stamp=STAMP, wait=True, log=lambda *_: None) == ARN


def test_uncompressed_model_data_and_no_routing(sm):
    client, stub = sm
    spec = dep.EndpointSpec(name="m", image_uri=SPEC.image_uri, role_arn=SPEC.role_arn,
                            model_data_url="s3://bucket/models/llama3", volume_size_gb=200)
    req = dep.model_request(spec, STAMP)
    assert req["PrimaryContainer"]["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": "s3://bucket/models/llama3/", "S3DataType": "S3Prefix", "CompressionType": "None"}
    cfg = dep.endpoint_config_request(spec, STAMP)
    assert "RoutingConfig" not in cfg["ProductionVariants"][0]
    stub.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"}, req)
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c"}, cfg)
    client.create_model(**req)          # the Stubber validates both against the service model
    client.create_endpoint_config(**cfg)
    tarball = dep.model_request(dep.EndpointSpec(name="m", image_uri="i", role_arn="r",
                                                 model_data_url="s3://b/model.tar.gz"), STAMP)
    assert tarball["PrimaryContainer"]["ModelDataUrl"] == "s3://b/model.tar.gz"


def test_service_model_rejects_a_bad_request():
    client = boto3.client("sagemaker", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x")
    bad = dep.endpoint_config_request(SPEC, STAMP)
    bad["ProductionVariants"][0]["InitialInstanceCount"] = "two"
    with Stubber(client) as stub:
        stub.add_response("create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c"})
        with pytest.raises(ParamValidationError, match="InitialInstanceCount"):
            client.create_endpoint_config(**bad)


def test_env_limits():
    with pytest.raises(ValueError, match="1024"):
        dep.environment(dep.EndpointSpec(name="m", image_uri="i", role_arn="r",
                                         extra_env={"X": "y" * 2000}))
    with pytest.raises(ValueError, match="routing"):
        dep.endpoint_config_request(dep.EndpointSpec(name="m", image_uri="i", role_arn="r",
                                                     routing="sticky"), STAMP)


def test_delete(sm):
    client, stub = sm
    stub.add_response("describe_endpoint", {"EndpointName": "kv", "EndpointArn": ARN, "EndpointConfigName": "c1",
                                            "EndpointStatus": "InService", "CreationTime": "2026-01-01T00:00:00Z",
                                            "LastModifiedTime": "2026-01-01T00:00:00Z"}, {"EndpointName": "kv"})
    stub.add_response("describe_endpoint_config", {
        "EndpointConfigName": "c1", "EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c1",
        "CreationTime": "2026-01-01T00:00:00Z",
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "m1"}]}, {"EndpointConfigName": "c1"})
    stub.add_response("delete_endpoint", {}, {"EndpointName": "kv"})
    stub.add_response("delete_endpoint_config", {}, {"EndpointConfigName": "c1"})
    stub.add_response("delete_model", {}, {"ModelName": "m1"})
    dep.delete(client, "kv", log=lambda *_: None)


def test_invoke_with_a_new_session():
    rt = boto3.client("sagemaker-runtime", region_name="us-east-1", aws_access_key_id="x",
                      aws_secret_access_key="x")
    body = json.dumps({"generated_text": "hi"}).encode()
    with Stubber(rt) as stub:
        stub.add_response("invoke_endpoint", {
            "Body": StreamingBody(io.BytesIO(body), len(body)), "ContentType": "application/json",
            "NewSessionId": "abc; Expires=2026-01-01T00:20:00Z"},
            {"EndpointName": "kv", "ContentType": "application/json", "Accept": "application/json",
             "Body": json.dumps({"inputs": "hi"}), "SessionId": "NEW_SESSION"})
        answer, sid = dep.invoke(rt, "kv", {"inputs": "hi"}, session_id="NEW_SESSION")
    assert answer == {"generated_text": "hi"} and sid == "abc"


def test_cli_dry_run_hides_the_token(capsys, monkeypatch):
    monkeypatch.setenv("MY_HF_TOKEN", "hf_secret")
    assert dep.main(["--name", "kv", "--image", SPEC.image_uri, "--role", SPEC.role_arn,
                     "--region", "us-east-1", "--hf-model-id", "org/model", "--hf-token-env", "MY_HF_TOKEN",
                     "--env", "SM_VLLM_MAX_MODEL_LEN=4096", "--dry-run"]) == 0
    out = capsys.readouterr().out
    shown = json.loads(out)
    assert shown["CreateModel"]["PrimaryContainer"]["Environment"]["HF_TOKEN"] == "***"
    assert "hf_secret" not in out


def test_hyperpod_example():
    doc = yaml.safe_load((REPO / "deploy" / "hyperpod_inference_endpoint.yaml").read_text())
    assert doc["apiVersion"].startswith("inference.sagemaker.aws.amazon.com/")
    assert doc["kind"] == "InferenceEndpointConfig"
    worker = doc["spec"]["worker"]
    assert worker["modelInvocationPort"]["containerPort"] == 8080
    assert "sagemaker-tiered-kvcache" in worker["image"]
    names = {e["name"] for e in worker["environmentVariables"]}
    assert {"KVCACHE_CPU_SIZE", "KVCACHE_DISK_PATH", "KVCACHE_REMOTE_URL", "SM_NUM_GPUS"} <= names
