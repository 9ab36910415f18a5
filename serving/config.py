"""Serving configuration: frozen dataclasses built in one function from SageMaker's world.

``build_serving_config(env)`` runs once at start-up, in the server process, before the
port is bound and before vLLM is imported. It reads the environment (SageMaker's,
the AWS vLLM/LMI container conventions, ``KVCACHE_*``) and the machine, and returns
everything the server and the engine need. It may take seconds: it generates the
default model when no model is given, and reads one ``config.json`` (downloading
only that file for a hub id). A bad setting raises ``ConfigError`` with one message
naming the variable.

Model, in order: ``HF_MODEL_ID`` (hub id or local folder; ``OPTION_MODEL_ID`` as in
LMI), a model in ``/opt/ml/model`` (if it has a config.json), else a small random
model generated offline (``serving.default_model``) under ``SERVING_DEFAULT_MODEL_DIR``.

Engine arguments: ``SM_NUM_GPUS`` -> ``--tensor-parallel-size``; every ``SM_VLLM_<ARG>``
-> ``--<arg>`` (lower case, ``_`` -> ``-``; ``true`` -> a bare flag, ``false`` ->
``--no-<arg>``); LMI's ``OPTION_<ARG>`` likewise, with LMI's names translated
(``OPTION_TENSOR_PARALLEL_DEGREE`` ...). ``SM_VLLM_*`` wins over ``OPTION_*``, both win
over our defaults.

Cache: ``cache.config`` reads every ``KVCACHE_*`` variable (the cache on or off, the
tiers, ``KVCACHE_WARM_PROMPTS``, ``KVCACHE_WARM_DRAM``); ``serving.sizing`` resolves the
tiers once and the result goes to the connector as one value
(``cache.vllm.kv_transfer_config``). The warm-up runs in ``serving.warmup`` before the
engine starts; the DRAM warm-up in ``serving.dram_warm`` once it is ready.

HTTP: port, timeouts and payload limit through the ``sagemaker-inference`` toolkit's
``Environment`` (``SAGEMAKER_BIND_TO_PORT``, ``SAGEMAKER_MODEL_SERVER_TIMEOUT``,
``SAGEMAKER_STARTUP_TIMEOUT``, ``SAGEMAKER_MAX_PAYLOAD_IN_MB``), log level from
``SAGEMAKER_CONTAINER_LOG_LEVEL``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional

from cache.config import cache_enabled, warm_dram, warm_prompts
from cache.errors import ConfigError, FootprintError
from cache.flags import parse_bool
from cache.footprint import KVFootprint, footprint_from_config
from cache.vllm import WORKER_EXTENSION, kv_transfer_config
from serving.conventions import engine_args, render, with_serving_properties
from serving.describe import effects
from serving.machine import Machine, probe_machine
from serving.model import ModelSource, hf_config, resolve_model, sagemaker_model_dir
from serving.ports import port_range_env
from serving.sizing import GiB, TierPlan, plan_tiers, weights_bytes

log = logging.getLogger(__name__)

__all__ = ["ConfigError", "ServingConfig", "build_serving_config"]

DEFAULT_PAYLOAD_BYTES = 6 * 1024 * 1024  # SageMaker's real-time invocation limit
# SageMaker's longest container start-up health check (ContainerStartupHealthCheckTimeoutInSeconds):
# without SAGEMAKER_STARTUP_TIMEOUT the server never gives up before the platform does.
PLATFORM_STARTUP_TIMEOUT_S = 3600
DEFAULT_MAX_N = 16  # SERVING_MAX_N: choices per request
DRAIN_SECONDS = 15.0  # SIGTERM -> SIGKILL is 30 s: drain, then ~10 s to stop vLLM
MAX_DRAIN_SECONDS = 18.0  # SERVING_DRAIN_SECONDS above this cannot stop in time
# SERVING_KEEP_ALIVE_SECONDS: how long an idle connection stays open. Longer than the idle
# time of a client's or proxy's connection pool (aiohttp 15 s, load balancers 60 s), so the
# client closes first: a server that closes an idle connection races the pool's next request
# on it, which fails with a reset or "Server disconnected" (uvicorn's own default is 5 s).
KEEP_ALIVE_SECONDS = 75


@dataclass(frozen=True)
class HttpSettings:
    host: str = "0.0.0.0"
    port: int = 8080
    max_payload_bytes: int = DEFAULT_PAYLOAD_BYTES
    invocation_timeout_s: float = 60.0  # a non-streamed request is aborted after this
    startup_timeout_s: float = 3600.0  # the engine must be ready within this
    drain_timeout_s: float = DRAIN_SECONDS  # SIGTERM: time given to requests in flight
    log_level: str = "INFO"
    sessions_enabled: bool = True  # SageMaker stateful sessions
    session_ttl_s: int = 1200
    sessions_path: Optional[str] = None  # the standards library's session folder (its default: /dev/shm)
    max_sessions: int = 1000  # open sessions at most (serving.sessions)
    max_n: int = DEFAULT_MAX_N  # most choices one request may ask for (n)
    keep_alive_s: int = KEEP_ALIVE_SECONDS  # an idle connection is closed after this (uvicorn takes whole seconds)


@dataclass(frozen=True)
class EngineSettings:
    vllm_args: tuple[str, ...]  # vLLM CLI arguments (its own parser checks them)
    arg_sources: tuple[tuple[str, str], ...] = ()  # (--flag, variable that set it)
    env: tuple[tuple[str, str], ...] = ()  # variables set for the engine processes
    served_model_name: str = "model"
    tensor_parallel_size: int = 1
    kvcache_enabled: bool = True
    # KVCACHE_WARM_PROMPTS: a JSON-lines file of prompts warmed (cache.tools.warm) by an engine of
    # its own before this one starts; None: no warm-up.
    warm_prompts: Optional[str] = None
    # KVCACHE_WARM_DRAM: bytes of the hottest shared entries copied into DRAM, with the warm
    # prompts, before /ping says healthy (serving.dram_warm); 0: /ping does not wait.
    warm_dram_bytes: int = 0
    model_source: Optional[ModelSource] = None  # an S3 model is fetched before vLLM starts


@dataclass(frozen=True)
class ServingConfig:
    model: ModelSource
    http: HttpSettings
    engine: EngineSettings
    plan: Optional[TierPlan]  # None when the tiered cache is disabled
    footprint: Optional[KVFootprint] = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    effects: tuple[tuple[str, str], ...] = ()  # (VARIABLE=value, what it set), for --print-config

    def describe(self) -> str:
        lines = [
            f"model {self.model.model} (from {self.model.source}); served as "
            f"{self.engine.served_model_name!r}; port {self.http.port}"
        ]
        if self.effects:
            width = min(48, max(len(k) for k, _ in self.effects))
            lines.append("settings and what they set:")
            lines += [f"  {k:<{width}} -> {v}" for k, v in self.effects]
        lines.append("vLLM " + " ".join(_redact(self.engine.vllm_args)))
        lines += [f"engine env {k}={v}" for k, v in self.engine.env]
        if self.engine.warm_prompts:
            lines.append(f"warm-up before serving: {self.engine.warm_prompts} (KVCACHE_WARM_PROMPTS)")
        if self.engine.warm_dram_bytes:
            lines.append(
                f"/ping healthy once DRAM holds the warm prompts and up to {self.engine.warm_dram_bytes:,} "
                "bytes of the hottest shared entries, or at the start-up timeout (KVCACHE_WARM_DRAM)"
            )
        lines += [f"note: {n}" for n in self.notes]
        if self.plan is not None:
            lines.append(self.plan.format(self.model.model))
        else:
            lines.append("KV cache tiers: off")
        return "\n".join(lines)


def _redact(args: tuple[str, ...]) -> list[str]:
    out, hide = [], False
    for a in args:
        out.append("***" if hide else a)
        hide = a in ("--hf-token", "--api-key")
    return out


# -- small parsers -------------------------------------------------------------
def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} must be an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value


@contextmanager
def _sagemaker_environ(env: Mapping[str, str]) -> Iterator[None]:
    """Let the toolkit, which reads ``os.environ``, see ``env``'s SAGEMAKER_* variables.

    Start-up only (single-threaded); ``os.environ`` is restored afterwards.
    """
    if env is os.environ:
        yield
        return
    saved = {k: v for k, v in os.environ.items() if k.startswith("SAGEMAKER_")}
    for k in saved:
        del os.environ[k]
    os.environ.update({k: str(v) for k, v in env.items() if k.startswith("SAGEMAKER_")})
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("SAGEMAKER_")]:
            del os.environ[k]
        os.environ.update(saved)


# -- HTTP ------------------------------------------------------------------------
def _http_settings(env: Mapping[str, str]) -> tuple[HttpSettings, list[str]]:
    from sagemaker_inference import environment, parameters

    notes = []
    try:
        with _sagemaker_environ(env):
            tk = environment.Environment()
            port = int(tk.inference_http_port)
            payload = tk.max_request_size
            timeout = tk.model_server_timeout_seconds or tk.model_server_timeout
            startup = tk.startup_timeout if env.get(parameters.STARTUP_TIMEOUT_ENV) else PLATFORM_STARTUP_TIMEOUT_S
            workers = tk.model_server_workers
    except ValueError as e:
        raise ConfigError(f"a SAGEMAKER_* setting is not a number: {e}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"{parameters.BIND_TO_PORT_ENV}={port} is not a TCP port")
    if workers not in (None, "", "1"):
        notes.append(
            f"{parameters.MODEL_SERVER_WORKERS_ENV}={workers} ignored: one engine per container batches every request"
        )
    level = str(env.get(parameters.LOG_LEVEL_ENV) or "INFO").strip().upper()
    if level.isdigit():
        level = logging.getLevelName(int(level))
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(
            f"{parameters.LOG_LEVEL_ENV}={env.get(parameters.LOG_LEVEL_ENV)!r} "
            "is not a log level (10/20/30/40 or DEBUG/INFO/WARNING/ERROR)"
        )
    http = HttpSettings(
        host=env.get("SERVING_HOST") or "0.0.0.0",
        port=port,
        max_payload_bytes=payload or DEFAULT_PAYLOAD_BYTES,
        invocation_timeout_s=float(timeout),
        startup_timeout_s=float(startup),
        log_level=level,
        sessions_enabled=parse_bool(env, "SAGEMAKER_ENABLE_STATEFUL_SESSIONS", True),
        session_ttl_s=_int(env, "SAGEMAKER_SESSIONS_EXPIRATION", 1200, minimum=1),
        sessions_path=env.get("SAGEMAKER_SESSIONS_PATH") or None,
        max_sessions=_int(env, "SERVING_MAX_SESSIONS", 1000, minimum=1),
        max_n=_int(env, "SERVING_MAX_N", DEFAULT_MAX_N, minimum=1),
        drain_timeout_s=float(_int(env, "SERVING_DRAIN_SECONDS", int(DRAIN_SECONDS), minimum=0)),
        keep_alive_s=_int(env, "SERVING_KEEP_ALIVE_SECONDS", KEEP_ALIVE_SECONDS, minimum=1),
    )
    if http.drain_timeout_s > MAX_DRAIN_SECONDS:
        raise ConfigError(
            f"SERVING_DRAIN_SECONDS={http.drain_timeout_s:.0f} leaves vLLM no time "
            f"to stop inside SageMaker's 30 s; at most {MAX_DRAIN_SECONDS:.0f}"
        )
    return http, notes


# -- engine arguments ------------------------------------------------------------
def _engine_cpu_kv_gib(env: Mapping[str, str], machine: Machine) -> Optional[int]:
    """vLLM's own KV pool on a CPU machine: ``VLLM_CPU_KVCACHE_SPACE`` or a small default."""
    if machine.has_gpu:
        return None
    if env.get("VLLM_CPU_KVCACHE_SPACE"):
        return _int(env, "VLLM_CPU_KVCACHE_SPACE", 1, minimum=1)
    return max(1, min(8, machine.ram_bytes // (16 * GiB)))


def _engine_kv_estimate(
    machine: Machine, args: dict[str, str], cpu_kv_gib: Optional[int], weights: Optional[int], footprint
) -> Optional[int]:
    """vLLM's own KV pool (L0) in bytes, as the plan shows it. ``--num-gpu-blocks-override``
    (``SM_VLLM_NUM_GPU_BLOCKS_OVERRIDE``) fixes the engine's block count on either platform,
    whatever memory it was given: then it is that many blocks of ``--block-size`` tokens."""
    blocks = args.get("--num-gpu-blocks-override", "")
    if blocks.isdigit():
        if footprint is None:
            return None
        return int(blocks) * _engine_block_size(machine, args, footprint) * footprint.bytes_per_token
    if cpu_kv_gib is not None:
        return cpu_kv_gib * GiB
    try:
        util = float(args.get("--gpu-memory-utilization", "0.9"))
    except ValueError:
        return None
    total = sum(g.total_bytes for g in machine.gpus)
    return max(0, int(total * util) - (weights or 0)) if weights is not None else None


def _engine_block_size(machine: Machine, args: dict[str, str], footprint) -> int:
    """The tokens per KV block vLLM 0.32 picks: ``--block-size``, else 16 on GPUs and 128
    on the CPU build (16 for MLA models there: ``vllm/platforms/cpu.py``)."""
    given = args.get("--block-size", "")
    if given.isdigit():
        return int(given)
    if machine.has_gpu or getattr(footprint, "attention", "") == "mla":
        return 16
    return 128


def _reserved_cpus(env: Mapping[str, str], machine: Machine, args: dict[str, str], kvcache: bool) -> Optional[int]:
    """The CPU build's cores kept off the model (``VLLM_CPU_NUM_OF_RESERVED_CPU``), chosen
    here rather than left to vLLM: it reserves one core per rank for its engine-core and
    API processes, and one *more* per rank whenever any KV connector is configured (meant
    for NIXL's transfer thread). With the tiered cache on, the server asks for what vLLM
    reserves without a connector, so turning the cache on never takes a compute core (on
    2 cores it would leave the model none to bind apart: a different layout). The cache's
    I/O threads run on the reserved cores (``cache.threads``), writers niced. ``None``:
    leave it to vLLM (GPU machines, the cache off, or the operator set it)."""
    if machine.has_gpu or not kvcache or "VLLM_CPU_NUM_OF_RESERVED_CPU" in env:
        return None
    world = 1
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        value = args.get(flag, "1")
        world *= int(value) if value.isdigit() and int(value) > 0 else 1
    # vLLM reserves one per local rank on x86, Arm and RISC-V, one in all elsewhere
    return world if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64", "riscv64") else 1


# -- the one builder ---------------------------------------------------------------
def build_serving_config(env: Optional[Mapping[str, str]] = None, machine: Optional[Machine] = None) -> ServingConfig:
    """The one place that turns the environment and the machine into a ``ServingConfig``."""
    env = os.environ if env is None else env
    machine = machine or probe_machine()
    env, notes = with_serving_properties(env, sagemaker_model_dir(env))
    http, http_notes = _http_settings(env)
    notes += http_notes
    model = resolve_model(env)
    hf = hf_config(model, env)

    gpus = len(machine.gpus)
    args: dict[str, str] = {"--model": model.model}
    sources: dict[str, str] = {"--model": model.source}
    if model.revision:
        args["--revision"] = model.revision
        sources["--revision"] = "HF_MODEL_REVISION"
    served = model.served_name
    args["--served-model-name"] = served
    tp = _int(env, "SM_NUM_GPUS", max(1, gpus), minimum=1)
    if tp > 1 or env.get("SM_NUM_GPUS"):
        args["--tensor-parallel-size"] = str(tp)
        sources["--tensor-parallel-size"] = "SM_NUM_GPUS"
    user, user_sources, user_notes = engine_args(env, gpus)
    notes += user_notes
    if "--tensor-parallel-size" in user:
        tp = _int({"tp": user["--tensor-parallel-size"]}, "tp", tp, minimum=1)

    kvcache = cache_enabled(env)
    if "--kv-transfer-config" in user and kvcache:
        kvcache = False
        notes.append(f"{user_sources['--kv-transfer-config']} sets its own KV connector; the tiered cache is off")

    # Sizing: the model's KV footprint against the machine.
    footprint = None
    if hf is not None:
        try:
            footprint = footprint_from_config(hf, user.get("--kv-cache-dtype"))
        except FootprintError as e:
            notes.append(f"KV footprint unknown: {e}")
    context = None
    if "--max-model-len" in user and user["--max-model-len"].isdigit():
        context = int(user["--max-model-len"])
    elif footprint is not None:
        context = footprint.max_context
    cpu_kv_gib = _engine_cpu_kv_gib(env, machine)
    weights = weights_bytes(model.local_dir)
    plan = None
    if kvcache:
        plan = plan_tiers(
            env,
            machine,
            footprint,
            weights_bytes=weights,
            engine_cpu_kv_bytes=(cpu_kv_gib or 0) * GiB,
            engine_kv_bytes=_engine_kv_estimate(machine, user, cpu_kv_gib, weights, footprint),
            engine_kv_blocks=user.get("--num-gpu-blocks-override"),
            reserved_cpus=_reserved_cpus(env, machine, {**args, **user}, kvcache),
            context_tokens=context,
        )
        args["--kv-transfer-config"] = json.dumps(kv_transfer_config(plan.cache))
    warm = warm_prompts(env, plan.cache if plan is not None else None)
    warm_bytes = warm_dram(env, plan.cache if plan is not None else None)
    if warm_bytes:  # the worker methods the DRAM warm-up calls (cache.vllm.warm_rpc)
        if "--worker-extension-cls" in user:
            raise ConfigError(
                f"KVCACHE_WARM_DRAM needs vLLM's --worker-extension-cls for the cache's "
                f"worker methods; {user_sources['--worker-extension-cls']} sets another"
            )
        args["--worker-extension-cls"] = WORKER_EXTENSION
        sources["--worker-extension-cls"] = "KVCACHE_WARM_DRAM"

    for flag, value in user.items():  # the user's arguments win over ours
        args[flag] = value
        sources[flag] = user_sources[flag]

    engine_env = []
    if cpu_kv_gib is not None and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        engine_env.append(("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_gib)))
    reserved = _reserved_cpus(env, machine, {**args, **user}, kvcache)
    if reserved is not None:
        engine_env.append(("VLLM_CPU_NUM_OF_RESERVED_CPU", str(reserved)))
    engine_env += port_range_env(env)
    engine = EngineSettings(
        vllm_args=render(args),
        arg_sources=tuple(sources.items()),
        env=tuple(engine_env),
        served_model_name=user.get("--served-model-name", served),
        tensor_parallel_size=tp,
        kvcache_enabled=kvcache,
        warm_prompts=warm,
        warm_dram_bytes=warm_bytes,
        model_source=model,
    )
    return ServingConfig(model, http, engine, plan, footprint, tuple(notes), effects(env, model, engine, http))
