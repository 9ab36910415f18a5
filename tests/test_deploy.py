"""deploy/sagemaker_endpoint.py against botocore's own service models: every request is
validated by botocore (no AWS call), sent through Stubbers, and ``invoke`` talks real HTTP
to a local server answering as SageMaker's runtime does."""

from __future__ import annotations

import io
import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import botocore.session
import pytest
from botocore.exceptions import ParamValidationError
from botocore.response import StreamingBody
from botocore.stub import ANY, Stubber

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "deploy"))  # the scripts import their siblings, as when run
import sagemaker_endpoint as cli  # noqa: E402
import sagemaker_requests as dep  # noqa: E402

ARN = "arn:aws:sagemaker:us-east-1:123456789012:endpoint/kv"
ROLE = "arn:aws:iam::123456789012:role/SageMakerExecution"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/sagemaker-tiered-kvcache:abc-gpu"
SPEC = dep.EndpointSpec(
    name="llama3-kv",
    image_uri=IMAGE,
    role_arn=ROLE,
    instance_type="ml.g5.12xlarge",
    hf_model_id="meta-llama/Meta-Llama-3-8B-Instruct",
    num_gpus=4,
    dram_size="40%",
    disk_size="60%",
    shared_url="curvine:///kvcache/llama3",
    curvine_masters="10.0.1.10:8995,10.0.1.11:8995",
    signing_key="k" * 32,
    subnets=("subnet-0a1b", "subnet-2c3d"),
    security_group_ids=("sg-0e4f",),
    routing="prefix-aware",
    extra_env={"SM_VLLM_MAX_MODEL_LEN": "32768"},
    tags={"team": "ml"},
)
STAMP = "20260101-000000"


def client(service: str):
    return boto3.client(service, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")


@pytest.fixture
def sm():
    c = client("sagemaker")
    with Stubber(c) as stub:
        yield c, stub
        stub.assert_no_pending_responses()


def test_requests_carry_the_tier_settings_vpc_and_startup_timeout():
    built = dep.requests(SPEC, STAMP)  # validated against botocore's models
    model = built["CreateModel"][1]
    env = model["PrimaryContainer"]["Environment"]
    assert env["HF_MODEL_ID"] == "meta-llama/Meta-Llama-3-8B-Instruct" and env["SM_NUM_GPUS"] == "4"
    assert env["KVCACHE_DRAM_SIZE"] == "40%" and env["KVCACHE_DISK_SIZE"] == "60%"
    assert env["KVCACHE_DISK_PATH"] == "/tmp/kvcache"
    assert env["KVCACHE_SHARED_URL"] == "curvine:///kvcache/llama3"
    assert env["KVCACHE_CURVINE_MASTERS"] == "10.0.1.10:8995,10.0.1.11:8995"
    assert env["KVCACHE_SIGNING_KEY"] == "k" * 32
    assert env["SAGEMAKER_ENABLE_STATEFUL_SESSIONS"] == "true"
    assert env["SM_VLLM_MAX_MODEL_LEN"] == "32768"
    assert model["VpcConfig"] == {"Subnets": ["subnet-0a1b", "subnet-2c3d"], "SecurityGroupIds": ["sg-0e4f"]}
    variant = built["CreateEndpointConfig"][1]["ProductionVariants"][0]
    # The container waits for its engine exactly as long as SageMaker waits for /ping.
    assert env["SAGEMAKER_STARTUP_TIMEOUT"] == str(variant["ContainerStartupHealthCheckTimeoutInSeconds"]) == "1800"
    assert variant["ModelName"] == model["ModelName"] == f"llama3-kv-{STAMP}"
    assert variant["RoutingConfig"]["RoutingStrategy"] == "PREFIX_AWARE"
    assert "HeadObject" not in built  # no client file to look for


def test_startup_timeout_follows_the_option_and_env_cannot_contradict_it():
    spec = dep.EndpointSpec(name="m", image_uri=IMAGE, role_arn=ROLE, startup_timeout_s=2400)
    env = dep.model_request(spec, STAMP)["PrimaryContainer"]["Environment"]
    variant = dep.endpoint_config_request(spec, STAMP)["ProductionVariants"][0]
    assert env["SAGEMAKER_STARTUP_TIMEOUT"] == "2400" == str(variant["ContainerStartupHealthCheckTimeoutInSeconds"])
    with pytest.raises(ValueError, match="--startup-timeout"):
        dep.environment(
            dep.EndpointSpec(name="m", image_uri=IMAGE, role_arn=ROLE, extra_env={"SAGEMAKER_STARTUP_TIMEOUT": "600"})
        )
    with pytest.raises(ParamValidationError, match="maximum 3600"):
        dep.requests(dep.EndpointSpec(name="m", image_uri=IMAGE, role_arn=ROLE, startup_timeout_s=4000), STAMP)


def _ami_cuda() -> dict[str, tuple[int, int]]:
    """CUDA version of each InferenceAmiVersion, read from botocore's own documentation."""
    shape = (
        botocore.session.get_session()
        .get_service_model("sagemaker")
        .shape_for("ProductionVariant")
        .members["InferenceAmiVersion"]
    )
    found = {}
    for name, body in re.findall(r"<dt>([\w.-]+)</dt>\s*<dd>(.*?)</dd>", shape.documentation, re.S):
        m = re.search(r"CUDA version: (\d+)\.(\d+)", body)
        if m:
            found[name] = (int(m.group(1)), int(m.group(2)))
    assert set(found) <= set(shape.enum) and found
    return found


def test_gpu_instances_get_an_ami_whose_driver_runs_the_image_cuda():
    cuda = _ami_cuda()
    assert cuda[dep.GPU_INFERENCE_AMI] >= dep.IMAGE_CUDA
    # Only that AMI is new enough: the default hosts (CUDA 12.x drivers) cannot run CUDA 13.
    assert [ami for ami, v in cuda.items() if v >= dep.IMAGE_CUDA] == [dep.GPU_INFERENCE_AMI]
    variant = dep.endpoint_config_request(SPEC, STAMP)["ProductionVariants"][0]
    assert variant["InferenceAmiVersion"] == dep.GPU_INFERENCE_AMI
    for itype in ("ml.p5.48xlarge", "ml.g6e.xlarge"):
        spec = dep.EndpointSpec(name="m", image_uri=IMAGE, role_arn=ROLE, instance_type=itype)
        variant = dep.endpoint_config_request(spec, STAMP)["ProductionVariants"][0]
        assert variant["InferenceAmiVersion"] == dep.GPU_INFERENCE_AMI
    cpu = dep.EndpointSpec(name="m", image_uri=IMAGE, role_arn=ROLE, instance_type="ml.m5.2xlarge")
    assert "InferenceAmiVersion" not in dep.endpoint_config_request(cpu, STAMP)["ProductionVariants"][0]
    with pytest.raises(ParamValidationError, match="InferenceAmiVersion"):
        dep.requests(
            dep.EndpointSpec(name="m", image_uri=IMAGE, role_arn=ROLE, inference_ami_version="al2-ami-gpu-99"), STAMP
        )


def test_the_gpu_image_is_the_vllm_line_whose_cuda_the_ami_matches():
    text = (REPO / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v0\.32\.\d+$", text, re.M), (
        "IMAGE_CUDA in deploy/sagemaker_endpoint.py was read for vLLM 0.32 (torch 2.13, CUDA 13.0)"
    )


def test_curvine_conf_must_be_in_the_model_data(sm):
    base = dict(name="m", image_uri=IMAGE, role_arn=ROLE, shared_url="curvine:///kv/m", signing_key="s" * 32)
    with pytest.raises(ValueError, match="no --model-data"):
        dep.model_request(dep.EndpointSpec(**base, curvine_conf="curvine.toml"), STAMP)
    with pytest.raises(ValueError, match="sees only the model data"):
        dep.model_request(
            dep.EndpointSpec(**base, model_data_url="s3://b/m/", curvine_conf="/etc/curvine/curvine-cluster.toml"),
            STAMP,
        )
    with pytest.raises(ValueError, match="not a file inside"):
        dep.model_request(dep.EndpointSpec(**base, model_data_url="s3://b/m/", curvine_conf="../x.toml"), STAMP)
    with pytest.raises(ValueError, match="needs --curvine-masters or --curvine-conf"):
        dep.model_request(dep.EndpointSpec(**base), STAMP)
    # Inside the model: passed relative to the model folder; the file is looked up in S3.
    spec = dep.EndpointSpec(
        **base, model_data_url="s3://bucket/models/m", curvine_conf="/opt/ml/model/curvine/curvine-cluster.toml"
    )
    built = dep.requests(spec, STAMP)
    environment = built["CreateModel"][1]["PrimaryContainer"]["Environment"]
    assert environment["KVCACHE_CURVINE_CONF"] == "curvine/curvine-cluster.toml"
    assert built["HeadObject"] == ("s3", {"Bucket": "bucket", "Key": "models/m/curvine/curvine-cluster.toml"})
    s3 = client("s3")
    client_, stub = sm
    with Stubber(s3) as s3stub:
        s3stub.add_client_error(
            "head_object", "404", "Not Found", http_status_code=404, expected_params=built["HeadObject"][1]
        )
        with pytest.raises(ValueError, match="does not exist in the model data"):
            cli.deploy(client_, spec, stamp=STAMP, wait=False, log=lambda *_: None, s3=s3)
        s3stub.add_response("head_object", {"ContentLength": 120}, built["HeadObject"][1])
        stub.add_response(
            "create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"}, built["CreateModel"][1]
        )
        stub.add_response(
            "create_endpoint_config",
            {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c"},
            built["CreateEndpointConfig"][1],
        )
        stub.add_client_error(
            "describe_endpoint", "ValidationException", "Could not find endpoint", expected_params={"EndpointName": "m"}
        )
        stub.add_response(
            "create_endpoint", {"EndpointArn": ARN}, {"EndpointName": "m", "EndpointConfigName": f"m-{STAMP}"}
        )
        assert cli.deploy(client_, spec, stamp=STAMP, wait=False, log=lambda *_: None, s3=s3) == ARN


def test_shared_tier_needs_a_signing_key_and_vpc_needs_both_halves():
    with pytest.raises(ValueError, match="signing key"):
        dep.environment(
            dep.EndpointSpec(
                name="m", image_uri=IMAGE, role_arn=ROLE, shared_url="curvine:///kv", curvine_masters="h:8995"
            )
        )
    with pytest.raises(ValueError, match="both --subnets and --security-groups"):
        dep.model_request(dep.EndpointSpec(name="m", image_uri=IMAGE, role_arn=ROLE, subnets=("subnet-1",)), STAMP)


def test_deploy_creates_model_config_and_endpoint(sm):
    client_, stub = sm
    stub.add_response(
        "create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"}, dep.model_request(SPEC, STAMP)
    )
    stub.add_response(
        "create_endpoint_config",
        {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c"},
        dep.endpoint_config_request(SPEC, STAMP),
    )
    stub.add_client_error(
        "describe_endpoint",
        "ValidationException",
        "Could not find endpoint",
        expected_params={"EndpointName": "llama3-kv"},
    )
    stub.add_response(
        "create_endpoint",
        {"EndpointArn": ARN},
        {
            "EndpointName": "llama3-kv",
            "EndpointConfigName": f"llama3-kv-{STAMP}",
            "Tags": [{"Key": "team", "Value": "ml"}],
        },
    )
    assert cli.deploy(client_, SPEC, stamp=STAMP, wait=False, log=lambda *_: None) == ARN


def test_redeploy_updates_in_place_and_waits(sm):
    client_, stub = sm
    stub.add_response(
        "create_model",
        {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"},
        {"ModelName": ANY, "PrimaryContainer": ANY, "ExecutionRoleArn": ANY, "VpcConfig": ANY, "Tags": ANY},
    )
    stub.add_response(
        "create_endpoint_config",
        {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c"},
        {"EndpointConfigName": ANY, "ProductionVariants": ANY, "Tags": ANY},
    )
    described = {
        "EndpointName": "llama3-kv",
        "EndpointArn": ARN,
        "EndpointConfigName": "old",
        "EndpointStatus": "InService",
        "CreationTime": "2026-01-01T00:00:00Z",
        "LastModifiedTime": "2026-01-01T00:00:00Z",
    }
    stub.add_response("describe_endpoint", described, {"EndpointName": "llama3-kv"})
    stub.add_response(
        "update_endpoint",
        {"EndpointArn": ARN},
        {"EndpointName": "llama3-kv", "EndpointConfigName": f"llama3-kv-{STAMP}"},
    )
    stub.add_response("describe_endpoint", described, {"EndpointName": "llama3-kv"})  # the waiter
    assert cli.deploy(client_, SPEC, stamp=STAMP, wait=True, log=lambda *_: None) == ARN


def test_uncompressed_model_data_and_no_routing(sm):
    client_, stub = sm
    spec = dep.EndpointSpec(
        name="m", image_uri=IMAGE, role_arn=ROLE, model_data_url="s3://bucket/models/llama3", volume_size_gb=200
    )
    req = dep.model_request(spec, STAMP)
    assert req["PrimaryContainer"]["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": "s3://bucket/models/llama3/",
        "S3DataType": "S3Prefix",
        "CompressionType": "None",
    }
    cfg = dep.endpoint_config_request(spec, STAMP)
    assert "RoutingConfig" not in cfg["ProductionVariants"][0]
    stub.add_response("create_model", {"ModelArn": "arn:aws:sagemaker:us-east-1:1:model/m"}, req)
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c"}, cfg)
    client_.create_model(**req)  # the Stubber validates both against the service model
    client_.create_endpoint_config(**cfg)
    tarball = dep.model_request(
        dep.EndpointSpec(name="m", image_uri="i", role_arn="r", model_data_url="s3://b/model.tar.gz"), STAMP
    )
    assert tarball["PrimaryContainer"]["ModelDataUrl"] == "s3://b/model.tar.gz"


def test_service_model_rejects_a_bad_request():
    bad = dep.endpoint_config_request(SPEC, STAMP)
    bad["ProductionVariants"][0]["InitialInstanceCount"] = "two"
    with pytest.raises(ParamValidationError, match="InitialInstanceCount"):
        dep.validate_request("sagemaker", "CreateEndpointConfig", bad)
    bad = dep.model_request(SPEC, STAMP)
    bad["VpcConfig"]["Subnets"] = ["subnet-%d" % i for i in range(17)]
    with pytest.raises(ParamValidationError, match="Subnets: 17 is over the service's maximum 16"):
        dep.validate_request("sagemaker", "CreateModel", bad)


def test_env_limits():
    with pytest.raises(ValueError, match="1024"):
        dep.environment(dep.EndpointSpec(name="m", image_uri="i", role_arn="r", extra_env={"X": "y" * 2000}))
    with pytest.raises(ValueError, match="routing"):
        dep.endpoint_config_request(dep.EndpointSpec(name="m", image_uri="i", role_arn="r", routing="sticky"), STAMP)


def test_delete(sm):
    client_, stub = sm
    stub.add_response(
        "describe_endpoint",
        {
            "EndpointName": "kv",
            "EndpointArn": ARN,
            "EndpointConfigName": "c1",
            "EndpointStatus": "InService",
            "CreationTime": "2026-01-01T00:00:00Z",
            "LastModifiedTime": "2026-01-01T00:00:00Z",
        },
        {"EndpointName": "kv"},
    )
    stub.add_response(
        "describe_endpoint_config",
        {
            "EndpointConfigName": "c1",
            "EndpointConfigArn": "arn:aws:sagemaker:us-east-1:1:ec/c1",
            "CreationTime": "2026-01-01T00:00:00Z",
            "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": "m1"}],
        },
        {"EndpointConfigName": "c1"},
    )
    stub.add_response("delete_endpoint", {}, {"EndpointName": "kv"})
    stub.add_response("delete_endpoint_config", {}, {"EndpointConfigName": "c1"})
    stub.add_response("delete_model", {}, {"ModelName": "m1"})
    cli.delete(client_, "kv", log=lambda *_: None)


class _Runtime(BaseHTTPRequestHandler):
    """Answers POST /endpoints/NAME/invocations as SageMaker's runtime does for a stateful
    session, and records the headers it received."""

    seen: list[dict[str, str]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        headers = {k.lower(): v for k, v in self.headers.items()}
        type(self).seen.append({"path": self.path, "body": body.decode(), **headers})
        self.send_response(200)
        sid = self.headers.get("X-Amzn-SageMaker-Session-Id")
        kind = json.loads(body).get("requestType")
        answer = json.dumps({"generated_text": "hi"}).encode()
        if kind == "NEW_SESSION" and sid == "NEW_SESSION":  # session answers are plain text
            self.send_header("X-Amzn-SageMaker-New-Session-Id", "sess-1; Expires=2026-01-01T00:20:00Z")
            answer = b"Session sess-1 created"
        elif kind == "CLOSE":
            self.send_header("X-Amzn-SageMaker-Closed-Session-Id", sid)
            answer = b"Session closed"
        self.send_header("Content-Type", "application/json" if answer.startswith(b"{") else "text/plain")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def test_invoke_opens_uses_and_closes_a_session_over_http():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Runtime)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rt = boto3.client(
            "sagemaker-runtime",
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
            endpoint_url=f"http://127.0.0.1:{server.server_port}",
        )
        answer, sid = cli.invoke(rt, "kv", {"inputs": "hi"}, session_id="NEW_SESSION", prefix_aware_id="user-7")
        assert answer == {"generated_text": "hi"} and sid == "sess-1"
        answer, sid = cli.invoke(rt, "kv", {"inputs": "more"}, session_id=sid)
        assert sid == "sess-1"
        _, sid = cli.invoke(rt, "kv", {"requestType": "CLOSE"}, session_id=sid)
        assert sid is None
        _, sid = cli.invoke(rt, "kv", {"inputs": "stateless"})
        assert sid is None
    finally:
        server.shutdown()
    opened, first, second, closed, last = _Runtime.seen[-5:]
    assert opened["path"] == "/endpoints/kv/invocations"
    assert json.loads(opened["body"]) == {"requestType": "NEW_SESSION"}
    assert opened["x-amzn-sagemaker-session-id"] == "NEW_SESSION"
    assert json.loads(first["body"]) == {"inputs": "hi"} and first["x-amzn-sagemaker-session-id"] == "sess-1"
    assert opened["x-amzn-sagemaker-prefix-aware-id"] == first["x-amzn-sagemaker-prefix-aware-id"] == "user-7"
    assert second["x-amzn-sagemaker-session-id"] == "sess-1" and closed["x-amzn-sagemaker-session-id"] == "sess-1"
    assert "x-amzn-sagemaker-prefix-aware-id" not in second and "x-amzn-sagemaker-session-id" not in last


def test_invoke_through_the_stubber_validates_the_parameters():
    rt = client("sagemaker-runtime")
    body = json.dumps({"generated_text": "hi"}).encode()
    created = b"Session abc created"
    common = {
        "EndpointName": "kv",
        "ContentType": "application/json",
        "Accept": "application/json",
        "PrefixAwareId": "u1",
    }
    with Stubber(rt) as stub:
        stub.add_response(
            "invoke_endpoint",
            {
                "Body": StreamingBody(io.BytesIO(created), len(created)),
                "ContentType": "text/plain",
                "NewSessionId": "abc; Expires=2026-01-01T00:20:00Z",
            },
            {**common, "Body": json.dumps({"requestType": "NEW_SESSION"}), "SessionId": "NEW_SESSION"},
        )
        stub.add_response(
            "invoke_endpoint",
            {"Body": StreamingBody(io.BytesIO(body), len(body)), "ContentType": "application/json"},
            {**common, "Body": json.dumps({"inputs": "hi"}), "SessionId": "abc"},
        )
        answer, sid = cli.invoke(rt, "kv", {"inputs": "hi"}, session_id="NEW_SESSION", prefix_aware_id="u1")
    assert answer == {"generated_text": "hi"} and sid == "abc"


def test_cli_dry_run_validates_and_hides_the_secrets(capsys, monkeypatch):
    monkeypatch.setenv("MY_HF_TOKEN", "hf_secret")
    monkeypatch.setenv("MY_KV_KEY", "kv_secret_key")
    assert (
        cli.main(
            [
                "--name",
                "kv",
                "--image",
                IMAGE,
                "--role",
                ROLE,
                "--region",
                "us-east-1",
                "--hf-model-id",
                "org/model",
                "--hf-token-env",
                "MY_HF_TOKEN",
                "--model-data",
                "s3://b/models/m/",
                "--shared-url",
                "curvine:///kvcache/m",
                "--curvine-conf",
                "curvine/curvine-cluster.toml",
                "--signing-key-env",
                "MY_KV_KEY",
                "--subnets",
                "subnet-0a1b,subnet-2c3d",
                "--security-groups",
                "sg-0e4f",
                "--env",
                "SM_VLLM_MAX_MODEL_LEN=4096",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    shown = json.loads(out)
    env = shown["CreateModel"]["PrimaryContainer"]["Environment"]
    assert env["HF_TOKEN"] == "***" and env["KVCACHE_SIGNING_KEY"] == "***"
    assert "hf_secret" not in out and "kv_secret_key" not in out
    assert shown["HeadObject"] == {"Bucket": "b", "Key": "models/m/curvine/curvine-cluster.toml"}
    assert shown["CreateModel"]["VpcConfig"]["Subnets"] == ["subnet-0a1b", "subnet-2c3d"]
    with pytest.raises(SystemExit):
        cli.main(["--name", "kv", "--image", IMAGE, "--role", ROLE, "--startup-timeout", "9000", "--dry-run"])
    assert "maximum 3600" in capsys.readouterr().err


def test_readme_deploy_example_passes_the_dry_run(capsys, monkeypatch):
    """docs/deploy.md's deploy command, as written there, with --dry-run."""
    readme = (REPO / "docs" / "deploy.md").read_text()
    block = re.search(r"```bash\n(python deploy/sagemaker_endpoint\.py .*?)```", readme, re.S).group(1)
    command = block.split("\npython deploy/sagemaker_endpoint.py --name llama3-8b-kv --delete")[0]
    argv = re.sub(r"\s+#.*$", "", command.replace("\\\n", " "), flags=re.M).split()[2:]
    argv = [a.replace("<tag>", "abc123") for a in argv]
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setenv("KV_SIGNING_SECRET", "k" * 32)
    assert cli.main(argv + ["--dry-run"]) == 0
    json.loads(capsys.readouterr().out)
