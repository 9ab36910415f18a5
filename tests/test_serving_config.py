"""serving.config: the environment and the machine -> one frozen ServingConfig (no engine)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from cache.config import CacheConfig, build_cache_config, config_from_connector
from cache.errors import ConfigError
from serving import config as serving_config
from serving.config import DEFAULT_PAYLOAD_BYTES, build_serving_config
from serving.machine import Gpu, Machine
from serving.sizing import DRAM_MARGIN, GiB

REPO = Path(__file__).resolve().parent.parent

LLAMA3_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
}
KV_8B = 32 * 8 * 128 * 2 * 2  # 131,072 bytes per token

CPU_BOX = Machine(ram_bytes=64 * GiB, cpus=8)
GPU_BOX = Machine(ram_bytes=192 * GiB, cpus=48, gpus=tuple(Gpu("NVIDIA A10G", 24 * GiB) for _ in range(4)))


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "llama3-8b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    (d / "model.safetensors").write_bytes(b"\0" * 4096)
    return d


@pytest.fixture
def env(tmp_path, model_dir):
    """A SageMaker-like environment with every folder under tmp_path."""
    return {
        "HF_MODEL_ID": str(model_dir),
        "SAGEMAKER_BASE_DIR": str(tmp_path / "ml"),
        "KVCACHE_DRAM_PATH": str(tmp_path / "dram"),
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
    }


def args_of(cfg) -> dict:
    """vLLM arguments as {--flag: value or True}."""
    out, args = {}, list(cfg.engine.vllm_args)
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = True
            i += 1
    return out


def connector_extra(cfg) -> dict:
    return json.loads(args_of(cfg)["--kv-transfer-config"])["kv_connector_extra_config"]


def connector_config(cfg, env=None) -> CacheConfig:
    """The configuration the connector reads back from the engine arguments."""
    return config_from_connector(connector_extra(cfg), env or {})


# -- model -------------------------------------------------------------------------
def test_hf_model_id_local_folder(env, model_dir):
    cfg = build_serving_config(env, CPU_BOX)
    assert cfg.model.source == "HF_MODEL_ID" and cfg.model.local_dir == str(model_dir)
    a = args_of(cfg)
    assert a["--model"] == str(model_dir) and a["--served-model-name"] == str(model_dir)
    assert cfg.footprint.bytes_per_token == KV_8B


def test_hub_id_with_revision_and_unreadable_config(env, monkeypatch):
    monkeypatch.setattr(serving_config, "hf_config", lambda model, env: None)  # offline
    cfg = build_serving_config(
        {**env, "HF_MODEL_ID": "meta-llama/Meta-Llama-3-8B", "HF_MODEL_REVISION": "abc123"}, CPU_BOX
    )
    a = args_of(cfg)
    assert a["--model"] == "meta-llama/Meta-Llama-3-8B" and a["--revision"] == "abc123"
    assert cfg.footprint is None and cfg.plan is not None  # sized in bytes only
    assert "unknown" in cfg.describe()


def test_bad_model_id(env):
    with pytest.raises(ConfigError, match="HF_MODEL_ID"):
        build_serving_config({**env, "HF_MODEL_ID": "/no/such/folder"}, CPU_BOX)


def test_opt_ml_model_when_no_model_id(env, tmp_path):
    sm_model = tmp_path / "ml" / "model"
    sm_model.mkdir(parents=True)
    (sm_model / "config.json").write_text(json.dumps(LLAMA3_8B))
    cfg = build_serving_config({k: v for k, v in env.items() if k != "HF_MODEL_ID"}, CPU_BOX)
    assert cfg.model.model == str(sm_model) and args_of(cfg)["--served-model-name"] == "model"


def test_default_model_generated_when_nothing_given(env, tmp_path, monkeypatch):
    made = []

    def fake_ensure(path, shape):  # the real generator is exercised by the server tests
        made.append(path)
        (tmp_path / "gen").mkdir(exist_ok=True)
        (tmp_path / "gen" / "config.json").write_text(json.dumps(LLAMA3_8B))

    monkeypatch.setattr("serving.default_model.ensure_model", fake_ensure)
    e = {k: v for k, v in env.items() if k != "HF_MODEL_ID"}
    e["SERVING_DEFAULT_MODEL_DIR"] = str(tmp_path / "gen")
    cfg = build_serving_config(e, CPU_BOX)
    assert made == [str(tmp_path / "gen")]
    assert cfg.model.source == "default" and args_of(cfg)["--served-model-name"] == "default-model"


# -- engine arguments ------------------------------------------------------------
def test_sm_num_gpus_and_sm_vllm_args(env):
    cfg = build_serving_config(
        {
            **env,
            "SM_NUM_GPUS": "4",
            "SM_VLLM_MAX_MODEL_LEN": "4096",
            "SM_VLLM_ENABLE_PREFIX_CACHING": "false",
            "SM_VLLM_ENFORCE_EAGER": "true",
            "SM_VLLM_GPU_MEMORY_UTILIZATION": "0.85",
        },
        GPU_BOX,
    )
    a = args_of(cfg)
    assert a["--tensor-parallel-size"] == "4" and cfg.engine.tensor_parallel_size == 4
    assert a["--max-model-len"] == "4096" and a["--gpu-memory-utilization"] == "0.85"
    assert a["--no-enable-prefix-caching"] is True and a["--enforce-eager"] is True
    assert dict(cfg.engine.arg_sources)["--max-model-len"] == "SM_VLLM_MAX_MODEL_LEN"
    assert cfg.plan.context_tokens == 4096


def test_gpus_default_to_tensor_parallel_over_all(env):
    assert args_of(build_serving_config(env, GPU_BOX))["--tensor-parallel-size"] == "4"
    assert "--tensor-parallel-size" not in args_of(build_serving_config(env, CPU_BOX))


def test_lmi_option_names(env):
    cfg = build_serving_config(
        {
            **env,
            "OPTION_TENSOR_PARALLEL_DEGREE": "max",
            "OPTION_MAX_ROLLING_BATCH_SIZE": "64",
            "OPTION_ROLLING_BATCH": "vllm",
            "OPTION_DTYPE": "fp16",
            "OPTION_MAX_MODEL_LEN": "2048",
            "SM_VLLM_MAX_MODEL_LEN": "1024",
        },
        GPU_BOX,
    )
    a = args_of(cfg)
    assert a["--tensor-parallel-size"] == "4" and a["--max-num-seqs"] == "64"
    assert a["--dtype"] == "float16" and "--rolling-batch" not in a  # LMI's name, vLLM's value
    assert a["--max-model-len"] == "1024"  # SM_VLLM_ wins over OPTION_
    assert any("OPTION_ROLLING_BATCH" in n for n in cfg.notes)


def test_connector_config_carries_resolved_sizes_not_the_secret(env):
    cfg = build_serving_config(
        {
            **env,
            "KVCACHE_DRAM_SIZE": "128MiB",
            "KVCACHE_DISK_SIZE": "1GiB",
            "KVCACHE_SIGNING_KEY": "s3cret",
            "KVCACHE_CHUNK_TOKENS": "512",
        },
        CPU_BOX,
    )
    tc = json.loads(args_of(cfg)["--kv-transfer-config"])
    assert tc["kv_connector"] == "TieredKVConnector"
    assert tc["kv_connector_module_path"] == "cache.vllm.connector" and tc["kv_role"] == "kv_both"
    sent = connector_config(cfg)  # (a 512-token chunk is 64 MiB of this model's KV: DRAM holds two)
    assert sent.dram_bytes == 128 * 2**20 and sent.disk_bytes == 2**30 and sent.chunk_tokens == 512
    assert "s3cret" not in " ".join(cfg.engine.vllm_args) and "s3cret" not in cfg.describe()
    # The connector reads back exactly the plan's configuration (its signing key from the
    # environment the engine processes inherit).
    assert connector_config(cfg, {"KVCACHE_SIGNING_KEY": "s3cret"}) == cfg.plan.cache
    # Tier counters reach /metrics through the connector's own stats: no worker extension.
    assert "--worker-extension-cls" not in args_of(cfg)


def test_cache_off(env):
    off = build_serving_config({**env, "KVCACHE_ENABLED": "false"}, CPU_BOX)
    assert off.plan is None and "--kv-transfer-config" not in args_of(off)
    own = build_serving_config(
        {**env, "SM_VLLM_KV_TRANSFER_CONFIG": '{"kv_connector":"X","kv_role":"kv_both"}'}, CPU_BOX
    )
    assert own.plan is None and args_of(own)["--kv-transfer-config"].startswith('{"kv_connector":"X"')
    assert any("SM_VLLM_KV_TRANSFER_CONFIG" in n for n in own.notes)


# -- shared tier admission, pre-warming ----------------------------------------------
def test_shared_admission_one_setting_passed_to_the_connector(env, tmp_path):
    l3 = {**env, "KVCACHE_SHARED_URL": f"file://{tmp_path}/l3"}
    assert build_cache_config(l3).shared_admission == "reused"  # the default
    cfg = build_serving_config({**l3, "KVCACHE_SHARED_ADMISSION": "all"}, CPU_BOX)
    assert cfg.plan.cache.shared_admission == "all"
    assert connector_config(cfg).shared_admission == "all"  # the connector agrees
    assert "publishes: all" in cfg.describe()
    assert build_cache_config({**l3, "KVCACHE_SHARED_ADMISSION": "none"}).shared_admission == "none"
    with pytest.raises(
        ConfigError, match="KVCACHE_SHARED_ADMISSION='sometimes' is unknown; choose one of reused, all, none"
    ):
        build_serving_config({**l3, "KVCACHE_SHARED_ADMISSION": "sometimes"}, CPU_BOX)


@pytest.fixture
def warm_env(env, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "You are a helpful assistant."}\n\n'
        '{"prompt_token_ids": [1, 2, 3]}\n'
        '{"messages": [{"role": "system", "content": "Be brief."}]}\n'
    )
    return {**env, "KVCACHE_SHARED_URL": f"file://{tmp_path}/l3", "KVCACHE_WARM_PROMPTS": str(prompts)}


def test_warm_prompts_checked_at_configuration(warm_env, tmp_path):
    cfg = build_serving_config(warm_env, CPU_BOX)
    assert cfg.engine.warm_prompts == warm_env["KVCACHE_WARM_PROMPTS"]
    assert "warm-up before serving" in cfg.describe()
    assert build_serving_config({**warm_env, "KVCACHE_WARM_PROMPTS": ""}, CPU_BOX).engine.warm_prompts is None
    bad = tmp_path / "bad.jsonl"
    for text, words in [
        ('{"prompt": "x"}\n{"text": "y"}\n', "line 2: each line must be a JSON object"),
        ("not json\n", "line 1: not JSON"),
        ("\n\n", "holds no prompts"),
        ('["prompt"]\n', "line 1: each line"),
    ]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=f"KVCACHE_WARM_PROMPTS='{bad}'.*{words}"):
            build_serving_config({**warm_env, "KVCACHE_WARM_PROMPTS": str(bad)}, CPU_BOX)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"KVCACHE_WARM_PROMPTS": "/no/such/prompts.jsonl"}, "cannot be read"),
        ({"KVCACHE_SHARED_URL": ""}, "set KVCACHE_SHARED_URL"),
        ({"KVCACHE_SHARED_ADMISSION": "none"}, "KVCACHE_SHARED_ADMISSION=none publishes nothing"),
        ({"KVCACHE_ENABLED": "false"}, "needs the tiered cache"),
    ],
)
def test_warm_prompts_that_cannot_work_are_config_errors(warm_env, change, words):
    with pytest.raises(ConfigError, match=f"KVCACHE_WARM_PROMPTS=.*{words}"):
        build_serving_config({**warm_env, **change}, CPU_BOX)


def test_engine_cpu_kv_pool_default_only_without_gpu(env):
    cpu = build_serving_config(env, CPU_BOX)
    assert dict(cpu.engine.env)["VLLM_CPU_KVCACHE_SPACE"] == "4"  # 64 GiB // 16
    small = build_serving_config(env, Machine(ram_bytes=8 * GiB, cpus=2))
    assert dict(small.engine.env)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in dict(
        build_serving_config({**env, "VLLM_CPU_KVCACHE_SPACE": "3"}, CPU_BOX).engine.env
    )
    assert build_serving_config(env, GPU_BOX).engine.env == ()


def test_the_cpu_binding_is_chosen_not_left_to_the_connector(env):
    """On the CPU build vLLM reserves one more core per rank whenever a KV connector is
    configured; the server asks for what it reserves without one, so the cache on or
    off binds the model the same way, and the plan says so."""
    on = build_serving_config(env, Machine(ram_bytes=16 * GiB, cpus=2))
    assert dict(on.engine.env)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert "the model computes on 1 of 2 cores" in on.describe()
    tp2 = build_serving_config({**env, "SM_VLLM_TENSOR_PARALLEL_SIZE": "2"}, CPU_BOX)
    assert dict(tp2.engine.env)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "2"
    off = build_serving_config({**env, "KVCACHE_ENABLED": "false"}, CPU_BOX)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in dict(off.engine.env)  # vLLM's own choice
    mine = build_serving_config({**env, "VLLM_CPU_NUM_OF_RESERVED_CPU": "3"}, CPU_BOX)
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in dict(mine.engine.env)  # the operator's, as set
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in dict(build_serving_config(env, GPU_BOX).engine.env)


@pytest.mark.parametrize("box, block", [(CPU_BOX, 128), (GPU_BOX, 16)])
def test_the_plan_shows_l0_as_the_block_override_holds_it(env, box, block):
    """``SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE`` fixes vLLM's block count whatever memory it
    was given: L0 is that many blocks of the platform's default block size."""
    cfg = build_serving_config({**env, "SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE": "256"}, box)
    assert cfg.plan.engine_kv_bytes == 256 * block * KV_8B
    assert f"~{256 * block:,} tokens" in cfg.describe() and "256 blocks (override)" in cfg.describe()
    sized = build_serving_config({**env, "SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE": "256", "SM_VLLM_BLOCK_SIZE": "32"}, box)
    assert sized.plan.engine_kv_bytes == 256 * 32 * KV_8B


# -- tier sizing -----------------------------------------------------------------
def test_dram_default_is_a_share_of_ram(env):
    cfg = build_serving_config(env, Machine(ram_bytes=16 * GiB, cpus=8))
    assert cfg.plan.cache.dram_bytes == int(16 * GiB * 0.2)
    assert cfg.plan.tokens(cfg.plan.cache.dram_bytes) == int(16 * GiB * 0.2) // KV_8B
    assert cfg.plan.cache.disk_bytes > 0  # half the free space under the disk folder


def test_dram_default_leaves_room_for_weights_and_engine(env):
    # 20% = 1.4 GiB; 7 - 1 (engine KV) - 1 (the worker's staging: 64 chunks, at most 1 GiB) - 4 (margin) = ~1 GiB
    box = Machine(ram_bytes=7 * GiB, cpus=2)
    cfg = build_serving_config(env, box)
    assert cfg.plan.cache.staging_bytes == 1 * GiB
    assert cfg.plan.cache.dram_bytes == 7 * GiB - 4096 - 1 * GiB - 1 * GiB - DRAM_MARGIN
    assert any("RAM left" in n for n in cfg.plan.notes)


def test_user_sizes_win_and_bad_sizes_are_named(env):
    cfg = build_serving_config({**env, "KVCACHE_DRAM_SIZE": "0"}, CPU_BOX)
    assert cfg.plan.cache.dram_bytes == 0
    with pytest.raises(ConfigError, match="KVCACHE_DRAM_SIZE"):
        build_serving_config({**env, "KVCACHE_DRAM_SIZE": "lots"}, CPU_BOX)
    with pytest.raises(ConfigError, match="KVCACHE_DISK_SIZE"):
        build_serving_config({**env, "KVCACHE_DISK_SIZE": "999TB"}, CPU_BOX)


def test_plan_block_is_readable(env):
    cfg = build_serving_config(
        {**env, "SM_VLLM_MAX_MODEL_LEN": "8192", "KVCACHE_DRAM_SIZE": "1GiB", "KVCACHE_DISK_SIZE": "2GiB"}, CPU_BOX
    )
    text = cfg.describe()
    assert "131,072 bytes (128.0 KiB) per token" in text
    assert "L1 dram" in text and "~8,192 tokens = 1 full-length requests" in text
    assert "L2 disk" in text and "~16,384 tokens = 2 full-length requests" in text
    assert "L3 shared off" in " ".join(text.split())
    assert "staging   1 worker(s) x 1.0 GiB" in text and "left out of L1" in text
    gpus = " ".join(build_serving_config({**env, "KVCACHE_STAGING_SIZE": "256MiB"}, GPU_BOX).describe().split())
    assert "staging 4 worker(s) x 256.0 MiB 1.0 GiB pinned host memory" in gpus


# -- HTTP settings from the toolkit ---------------------------------------------
def test_http_defaults(env):
    http = build_serving_config(env, CPU_BOX).http
    assert (http.port, http.max_payload_bytes, http.invocation_timeout_s) == (8080, DEFAULT_PAYLOAD_BYTES, 60)
    assert http.sessions_enabled and http.session_ttl_s == 1200 and http.log_level == "INFO"
    # above the idle timeouts of clients' connection pools (aiohttp 15 s, load balancers 60 s)
    assert http.keep_alive_s > 60
    assert build_serving_config({**env, "SERVING_KEEP_ALIVE_SECONDS": "20"}, CPU_BOX).http.keep_alive_s == 20


def test_http_from_sagemaker_variables(env):
    http = build_serving_config(
        {
            **env,
            "SAGEMAKER_BIND_TO_PORT": "9000",
            "SAGEMAKER_MAX_PAYLOAD_IN_MB": "2",
            "SAGEMAKER_MODEL_SERVER_TIMEOUT": "120",
            "SAGEMAKER_STARTUP_TIMEOUT": "900",
            "SAGEMAKER_CONTAINER_LOG_LEVEL": "10",
            "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "false",
        },
        CPU_BOX,
    ).http
    assert (http.port, http.max_payload_bytes, http.invocation_timeout_s) == (9000, 2 * 2**20, 120)
    assert http.startup_timeout_s == 900 and http.log_level == "DEBUG" and not http.sessions_enabled


@pytest.mark.parametrize(
    "var,value",
    [
        ("SAGEMAKER_BIND_TO_PORT", "http"),
        ("SAGEMAKER_BIND_TO_PORT", "70000"),
        ("SAGEMAKER_MODEL_SERVER_TIMEOUT", "soon"),
        ("SAGEMAKER_CONTAINER_LOG_LEVEL", "LOUD"),
        ("SAGEMAKER_ENABLE_STATEFUL_SESSIONS", "maybe"),
        ("SM_NUM_GPUS", "two"),
        ("SERVING_KEEP_ALIVE_SECONDS", "0"),
        ("SERVING_KEEP_ALIVE_SECONDS", "forever"),
    ],
)
def test_bad_settings_are_config_errors(env, var, value):
    with pytest.raises(ConfigError):
        build_serving_config({**env, var: value}, CPU_BOX)


@pytest.mark.parametrize(
    "text,value",
    [
        ("Yes", True),
        (" on ", True),
        ("1", True),
        ("TRUE", True),
        ("No", False),
        ("OFF", False),
        ("0", False),
        ("false", False),
    ],
)
def test_server_flags_take_the_cache_spellings(env, monkeypatch, text, value):
    """The server's true/false settings read by cache.flags, as KVCACHE_* ones are."""
    http = build_serving_config({**env, "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": text}, CPU_BOX).http
    assert http.sessions_enabled is value
    # SERVING_DEFAULT_MODEL with no SageMaker model folder: unset or true generates the
    # default model; false refuses to serve without a model.
    monkeypatch.setattr("serving.default_model.ensure_model", lambda path, shape: None)
    plain = {
        **_no_model_id(env),
        "SERVING_DEFAULT_MODEL": text,
        "SERVING_DEFAULT_MODEL_DIR": env["HF_MODEL_ID"],
    }  # a model made already
    if value:
        assert build_serving_config(plain, CPU_BOX).model.source == "default"
    else:
        with pytest.raises(ConfigError, match="no model to serve"):
            build_serving_config(plain, CPU_BOX)


def test_toolkit_sees_only_the_given_environment(env, monkeypatch):
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "1234")
    assert build_serving_config(env, CPU_BOX).http.port == 8080
    import os

    assert os.environ["SAGEMAKER_BIND_TO_PORT"] == "1234"  # restored


# -- vLLM's own parser accepts what we render (imports vLLM: slow) --------------
def test_vllm_parser_accepts_our_arguments_and_names_bad_variables(env):
    from serving.engine_args import parse_engine_args

    cfg = build_serving_config(
        {**env, "SM_VLLM_MAX_MODEL_LEN": "4096", "SM_VLLM_ENABLE_PREFIX_CACHING": "false"}, CPU_BOX
    )
    args = parse_engine_args(cfg.engine)
    assert args.max_model_len == 4096 and args.enable_prefix_caching is False
    assert args.kv_transfer_config.kv_connector == "TieredKVConnector"
    assert args.kv_transfer_config.kv_connector_extra_config == connector_extra(cfg)
    bad = build_serving_config({**env, "SM_VLLM_MAX_MODEL_LEN": "long"}, CPU_BOX)
    with pytest.raises(ConfigError, match="SM_VLLM_MAX_MODEL_LEN"):
        parse_engine_args(bad.engine)
    unknown = build_serving_config({**env, "SM_VLLM_NO_SUCH_FLAG": "1"}, CPU_BOX)
    with pytest.raises(ConfigError, match="no-such-flag"):
        parse_engine_args(unknown.engine)
    assert shlex.join(cfg.engine.vllm_args)  # printable as a command line


def test_warm_up_engine_gets_the_serving_engine_arguments(warm_env):
    from serving.engine_args import parse_engine_args
    from serving.warmup import warm_arguments

    cfg = build_serving_config(
        {
            **warm_env,
            "SM_VLLM_MAX_MODEL_LEN": "4096",
            "SM_VLLM_ENFORCE_EAGER": "true",
            "SM_VLLM_ENABLE_PREFIX_CACHING": "false",
        },
        CPU_BOX,
    )
    model, cache, engine_args = warm_arguments(parse_engine_args(cfg.engine))
    assert model == warm_env["HF_MODEL_ID"] and cache == connector_extra(cfg)
    assert engine_args["max_model_len"] == 4096 and engine_args["enforce_eager"] is True
    assert engine_args["served_model_name"] == [warm_env["HF_MODEL_ID"]]
    # warm() sets these itself (its connector, prefix caching on); vllm.LLM takes the rest
    assert not {"model", "kv_transfer_config", "enable_prefix_caching"} & set(engine_args)


# -- the shared tier's URL is checked by the server, before any engine ----------------
@pytest.mark.parametrize(
    "url,words",
    [
        ("nope://x", "not a URL fsspec knows"),
        ("curvine:///kv", "needs Curvine's Python SDK"),  # no SDK installed here
        ("file:///no/such/mount/kv", "mounted there"),
    ],
)
def test_a_bad_shared_url_is_a_configuration_error(env, url, words):
    with pytest.raises(ConfigError, match=f"KVCACHE_SHARED_URL={url!r}.*{words}"):
        build_serving_config({**env, "KVCACHE_SHARED_URL": url, "KVCACHE_CURVINE_MASTERS": "cv-0:8995"}, CPU_BOX)


def test_the_server_exits_2_on_a_bad_shared_url(env):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHE_", "SAGEMAKER_", "SM_"))}
    run_env.update(
        env,
        KVCACHE_SHARED_URL="curvine:///kv",
        KVCACHE_CURVINE_MASTERS="cv-0:8995",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    )
    run = subprocess.run(
        [sys.executable, "-m", "serving", "--print-config"],
        env=run_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "configuration error: KVCACHE_SHARED_URL='curvine:///kv' needs Curvine's Python SDK" in run.stderr


def test_the_plan_says_when_the_dram_folder_is_too_small(env, tmp_path, monkeypatch, caplog):
    """A pod's 64 MiB /dev/shm and a model whose chunk is larger: L1 off, said loudly."""
    from tests.test_config import small_shm

    small_shm(monkeypatch, tmp_path, 16 * 2**20)  # Llama 3 8B: 256 tokens x 128 KiB = 32 MiB a chunk
    cfg = build_serving_config({**env, "KVCACHE_DRAM_PATH": str(tmp_path / "shm")}, CPU_BOX)
    assert cfg.plan.cache.dram_bytes == 0
    text = " ".join(cfg.describe().split())
    assert "L1 dram " + str(tmp_path / "shm") + " off" in text
    assert "note: WARNING: DRAM tier off: 16.0 MiB" in text and "cannot hold one chunk" in text
    assert any("DRAM tier off" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


# -- the model: never the wrong one ---------------------------------------------------
def _no_model_id(env):
    return {k: v for k, v in env.items() if k != "HF_MODEL_ID"}


def test_sm_vllm_model_is_the_model_everywhere(env, model_dir):
    cfg = build_serving_config({**_no_model_id(env), "SM_VLLM_MODEL": str(model_dir)}, CPU_BOX)
    a = args_of(cfg)
    assert cfg.model.source == "SM_VLLM_MODEL" and a["--model"] == str(model_dir)
    assert list(cfg.engine.vllm_args).count("--model") == 1
    assert cfg.engine.served_model_name == a["--served-model-name"] == str(model_dir)
    assert cfg.footprint.bytes_per_token == KV_8B  # sized from that model's config.json
    # it wins over HF_MODEL_ID, as the SageMaker vLLM container's own argument
    other = build_serving_config({**env, "SM_VLLM_MODEL": "org/other"}, CPU_BOX)
    assert other.model.model == "org/other" and other.engine.served_model_name == "org/other"


def test_model_artifact_one_folder_deep_is_found(env, tmp_path):
    nested = tmp_path / "ml" / "model" / "llama3-8b"
    nested.mkdir(parents=True)
    (nested / "config.json").write_text(json.dumps(LLAMA3_8B))
    cfg = build_serving_config(_no_model_id(env), CPU_BOX)
    assert cfg.model.model == str(nested) and cfg.footprint.bytes_per_token == KV_8B
    assert build_serving_config({**env, "HF_MODEL_ID": str(tmp_path / "ml" / "model")}, CPU_BOX).model.model == str(
        nested
    )


def test_empty_sagemaker_model_folder_stops_instead_of_serving_a_random_model(env, tmp_path, monkeypatch):
    (tmp_path / "ml" / "model").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no model to serve: .* holds no model"):
        build_serving_config(_no_model_id(env), CPU_BOX)
    made = []
    monkeypatch.setattr("serving.default_model.ensure_model", lambda path, shape: made.append(path))
    cfg = build_serving_config(
        {**_no_model_id(env), "SERVING_DEFAULT_MODEL": "true", "SERVING_DEFAULT_MODEL_DIR": env["HF_MODEL_ID"]}, CPU_BOX
    )
    assert cfg.model.source == "default" and made


def test_empty_model_folder_exits_2_with_one_message(tmp_path):
    import subprocess
    import sys

    (tmp_path / "ml" / "model").mkdir(parents=True)
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "SAGEMAKER_BASE_DIR": str(tmp_path / "ml"),
        "KVCACHE_DRAM_PATH": str(tmp_path / "dram"),
        "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
    }
    run = subprocess.run(
        [sys.executable, "-m", "serving", "--print-config"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("configuration error: no model to serve") == 1


# -- TGI and LMI settings ---------------------------------------------------------
def test_tgi_settings_become_vllm_arguments(env):
    cfg = build_serving_config(
        {
            **env,
            "HF_MODEL_QUANTIZE": "bitsandbytes-nf4",
            "HF_MODEL_TRUST_REMOTE_CODE": "true",
            "MAX_INPUT_LENGTH": "3000",
            "MAX_TOTAL_TOKENS": "4096",
            "MAX_BATCH_PREFILL_TOKENS": "8192",
        },
        CPU_BOX,
    )
    a, src = args_of(cfg), dict(cfg.engine.arg_sources)
    assert a["--quantization"] == "bitsandbytes" and a["--trust-remote-code"] is True
    assert a["--max-model-len"] == "4096" and a["--max-num-batched-tokens"] == "8192"
    assert src["--max-model-len"] == "MAX_TOTAL_TOKENS" and cfg.plan.context_tokens == 4096
    assert any("MAX_INPUT_LENGTH=3000" in n for n in cfg.notes)
    with pytest.raises(ConfigError, match="MAX_INPUT_LENGTH=5000 must be below MAX_TOTAL_TOKENS=4096"):
        build_serving_config({**env, "MAX_INPUT_LENGTH": "5000", "MAX_TOTAL_TOKENS": "4096"}, CPU_BOX)
    with pytest.raises(ConfigError, match="MAX_TOTAL_TOKENS='lots'"):
        build_serving_config({**env, "MAX_TOTAL_TOKENS": "lots"}, CPU_BOX)
    # OPTION_ and SM_VLLM_ win over TGI's
    assert (
        args_of(build_serving_config({**env, "MAX_TOTAL_TOKENS": "4096", "OPTION_MAX_MODEL_LEN": "2048"}, CPU_BOX))[
            "--max-model-len"
        ]
        == "2048"
    )


@pytest.mark.parametrize("lmi,vllm", [("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32"), ("auto", "auto")])
def test_lmi_dtype_names(env, lmi, vllm):
    assert args_of(build_serving_config({**env, "OPTION_DTYPE": lmi}, CPU_BOX))["--dtype"] == vllm


def test_serving_properties_in_the_model_folder(env, tmp_path, model_dir):
    sm = tmp_path / "ml" / "model"
    sm.mkdir(parents=True)
    (sm / "serving.properties").write_text(
        f"engine=Python\noption.model_id={model_dir}\noption.dtype=bf16\noption.max_model_len=2048\n# note\n"
    )
    cfg = build_serving_config({**_no_model_id(env), "OPTION_MAX_MODEL_LEN": "1024"}, CPU_BOX)
    a = args_of(cfg)
    assert cfg.model.source == "OPTION_MODEL_ID" and a["--model"] == str(model_dir)
    assert a["--dtype"] == "bfloat16" and a["--max-model-len"] == "1024"  # the environment wins
    assert any("OPTION_MAX_MODEL_LEN from the environment wins" in n for n in cfg.notes)
    assert any("OPTION_ENGINE" in n for n in cfg.notes)
    (sm / "serving.properties").write_text("option.dtype\n")
    with pytest.raises(ConfigError, match="serving.properties, line 1"):
        build_serving_config(_no_model_id(env), CPU_BOX)


def test_unknown_lmi_options_are_dropped_with_a_note_sm_vllm_ones_refused(env, caplog):
    from serving.engine_args import parse_engine_args

    cfg = build_serving_config(
        {**env, "OPTION_ROLLING_BATCH_SIZE_X": "4", "OPTION_ENABLE_STREAMING": "true", "OPTION_MAX_MODEL_LEN": "2048"},
        CPU_BOX,
    )
    with caplog.at_level("INFO", logger="serving.engine_args"):
        args = parse_engine_args(cfg.engine)
    assert args.max_model_len == 2048
    assert "OPTION_ENABLE_STREAMING: vLLM has no --enable-streaming; ignored" in caplog.text
    bad = build_serving_config({**env, "SM_VLLM_ENABLE_STREAMING": "true"}, CPU_BOX)
    with pytest.raises(ConfigError, match="enable-streaming"):
        parse_engine_args(bad.engine)


# -- S3 models, downloaded with boto3 (a local S3: moto's server) ------------------------
@pytest.fixture
def s3(monkeypatch):
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
    }.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3")
    client.create_bucket(Bucket="models")
    yield client
    server.stop()


@pytest.mark.parametrize("var", ["OPTION_MODEL_ID", "HF_MODEL_ID"])
def test_s3_model_id_is_downloaded_with_boto3(env, tmp_path, s3, var):
    from serving.model import fetch_model

    s3.put_object(Bucket="models", Key="llama/v1/config.json", Body=json.dumps(LLAMA3_8B).encode())
    s3.put_object(Bucket="models", Key="llama/v1/model.safetensors", Body=b"\0" * 1000)
    s3.put_object(Bucket="models", Key="llama/v1/tokenizer/tokenizer.json", Body=b"{}")
    e = {**_no_model_id(env), var: "s3://models/llama/v1", "SERVING_DOWNLOAD_DIR": str(tmp_path / "dl")}
    cfg = build_serving_config(e, CPU_BOX)
    local = tmp_path / "dl" / "models" / "llama" / "v1"
    assert cfg.model.s3_uri == "s3://models/llama/v1" and args_of(cfg)["--model"] == str(local)
    assert cfg.footprint.bytes_per_token == KV_8B  # config.json only, at configuration
    assert sorted(p.name for p in local.iterdir()) == ["config.json"]
    assert fetch_model(cfg.model) == 2  # the rest, before vLLM starts
    assert (local / "tokenizer" / "tokenizer.json").read_bytes() == b"{}"
    assert (local / "model.safetensors").stat().st_size == 1000
    assert fetch_model(cfg.model) == 0  # already there
    with pytest.raises(ConfigError, match="cannot download the model from s3://nobucket/x"):
        build_serving_config({**e, var: "s3://nobucket/x"}, CPU_BOX)


def test_an_s3_object_replaced_by_one_of_the_same_size_is_fetched_again(env, tmp_path, s3):
    """A file is kept only while its object's ETag is the one it was downloaded with; the
    ETags recorded go into the weights' fingerprint (the cache namespace)."""
    from cache.weights import S3_MANIFEST, fingerprint
    from serving.model import fetch_model

    s3.put_object(Bucket="models", Key="m/config.json", Body=json.dumps(LLAMA3_8B).encode())
    s3.put_object(Bucket="models", Key="m/model.bin", Body=b"\1" * 1000)
    e = {**_no_model_id(env), "HF_MODEL_ID": "s3://models/m", "SERVING_DOWNLOAD_DIR": str(tmp_path / "dl")}
    model = build_serving_config(e, CPU_BOX).model
    assert fetch_model(model) == 1 and fetch_model(model) == 0
    before = fingerprint(model.local_dir)
    manifest = json.loads((tmp_path / "dl" / "models" / "m" / S3_MANIFEST).read_text())
    assert sorted(manifest) == ["config.json", "model.bin"]
    s3.put_object(Bucket="models", Key="m/model.bin", Body=b"\2" * 1000)  # same size, new weights
    assert fetch_model(model) == 1
    assert (tmp_path / "dl" / "models" / "m" / "model.bin").read_bytes() == b"\2" * 1000
    assert fingerprint(model.local_dir).digest != before.digest


# -- start-up timeout, ports, --print-config -----------------------------------------
def test_startup_timeout_default_is_never_shorter_than_the_platforms(env):
    assert build_serving_config(env, CPU_BOX).http.startup_timeout_s == 3600
    assert build_serving_config({**env, "SAGEMAKER_STARTUP_TIMEOUT": "1800"}, CPU_BOX).http.startup_timeout_s == 1800


def test_safe_port_range_reaches_the_engine(env):
    cfg = build_serving_config({**env, "SAGEMAKER_SAFE_PORT_RANGE": "20000-20999"}, CPU_BOX)
    assert dict(cfg.engine.env)["VLLM_PORT"] == "20000"
    for bad, words in [
        ({"SAGEMAKER_SAFE_PORT_RANGE": "20000"}, "not a port range"),
        ({"SAGEMAKER_SAFE_PORT_RANGE": "9-1"}, "not a port range"),
        ({"SAGEMAKER_SAFE_PORT_RANGE": "20000-20999", "VLLM_PORT": "1234"}, "outside"),
    ]:
        with pytest.raises(ConfigError, match=words):
            build_serving_config({**env, **bad}, CPU_BOX)


def test_print_config_says_which_variable_set_what(env):
    cfg = build_serving_config(
        {
            **env,
            "SM_VLLM_MAX_MODEL_LEN": "4096",
            "OPTION_DTYPE": "bf16",
            "SAGEMAKER_BIND_TO_PORT": "9000",
            "SAGEMAKER_SAFE_PORT_RANGE": "20000-20999",
            "KVCACHE_SIGNING_KEY": "s3cret",
        },
        CPU_BOX,
    )
    text = cfg.describe()
    for line in (
        f"HF_MODEL_ID={env['HF_MODEL_ID']}",
        "SM_VLLM_MAX_MODEL_LEN=4096",
        "-> --max-model-len 4096",
        "OPTION_DTYPE=bf16",
        "-> --dtype bfloat16",
        "SAGEMAKER_BIND_TO_PORT=9000",
        "-> port 9000",
        "SAGEMAKER_SAFE_PORT_RANGE=20000-20999",
        "VLLM_PORT=20000",
        "SAGEMAKER_STARTUP_TIMEOUT (default)",
        "-> start-up timeout (s) 3600",
        "KVCACHE_SIGNING_KEY=***",
    ):
        assert line in text, line
    assert "s3cret" not in text


def test_plan_counts_a_hybrid_models_windows_and_state_once_per_request(env, model_dir):
    gemma3 = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "hidden_size": 5376,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 131072,
    }
    (model_dir / "config.json").write_text(json.dumps(gemma3))
    sized = {**env, "SM_VLLM_MAX_MODEL_LEN": "8192", "KVCACHE_DRAM_SIZE": "4GiB", "KVCACHE_DISK_SIZE": "2GiB"}
    text = build_serving_config(sized, CPU_BOX).describe()
    # 10 full layers x 80 KiB per token + 52 sliding layers x 8 KiB x their 1,024-token window
    per_request = 81_920 * 8192 + 52 * 8192 * 1024
    assert f"~{4 * GiB * 8192 // per_request:,} tokens = {4 * GiB // per_request} full-length requests" in text
    assert "52 sliding-window layers" in text
    granite = dict(LLAMA3_8B, model_type="granitemoehybrid", layer_types=["linear_attention", "full_attention"] * 16)
    (model_dir / "config.json").write_text(json.dumps(granite))
    assert "the tiered cache turns itself off" in build_serving_config(sized, CPU_BOX).describe()
