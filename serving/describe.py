"""What each setting did, for ``python -m serving --print-config`` and the start-up log.

Runs once at start-up in the server process; pure. ``effects`` pairs every variable
that was set (and the defaults that matter) with what it set: a vLLM argument, an HTTP
setting, a variable for the engine processes, or the tier plan.
"""

from __future__ import annotations

from typing import Iterator, Mapping

HTTP_VARIABLES = (
    ("SAGEMAKER_BIND_TO_PORT", "port", lambda h: str(h.port)),
    ("SAGEMAKER_MODEL_SERVER_TIMEOUT", "request timeout (s)", lambda h: f"{h.invocation_timeout_s:.0f}"),
    ("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS", "request timeout (s)", lambda h: f"{h.invocation_timeout_s:.0f}"),
    ("SAGEMAKER_STARTUP_TIMEOUT", "start-up timeout (s)", lambda h: f"{h.startup_timeout_s:.0f}"),
    ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "payload limit (bytes)", lambda h: f"{h.max_payload_bytes:,}"),
    ("SAGEMAKER_CONTAINER_LOG_LEVEL", "log level", lambda h: h.log_level),
    ("SAGEMAKER_ENABLE_STATEFUL_SESSIONS", "stateful sessions", lambda h: "on" if h.sessions_enabled else "off"),
    ("SAGEMAKER_SESSIONS_EXPIRATION", "session lifetime (s)", lambda h: str(h.session_ttl_s)),
    ("SAGEMAKER_SESSIONS_PATH", "session folder", lambda h: str(h.sessions_path)),
    ("SERVING_MAX_SESSIONS", "open sessions at most", lambda h: str(h.max_sessions)),
    ("SERVING_HOST", "bind address", lambda h: h.host),
    ("SERVING_MAX_N", "most choices per request (n)", lambda h: str(h.max_n)),
    ("SERVING_DRAIN_SECONDS", "drain deadline after SIGTERM (s)", lambda h: f"{h.drain_timeout_s:.0f}"),
    ("SERVING_KEEP_ALIVE_SECONDS", "idle connection closed after (s)", lambda h: str(h.keep_alive_s)),
)
SHOWN_DEFAULTS = (
    "SAGEMAKER_BIND_TO_PORT",
    "SAGEMAKER_MODEL_SERVER_TIMEOUT",
    "SAGEMAKER_STARTUP_TIMEOUT",
    "SAGEMAKER_MAX_PAYLOAD_IN_MB",
    "SERVING_MAX_N",
    "SERVING_DRAIN_SECONDS",
)


def _rendered(flag: str, value: str) -> str:
    low = value.lower()
    return flag if low == "true" else f"--no-{flag[2:]}" if low == "false" else f"{flag} {value}"


def effects(env: Mapping[str, str], model, engine, http) -> tuple[tuple[str, str], ...]:
    """``(setting, effect)`` pairs; a setting left unset shows as ``NAME (default)``."""
    out: list[tuple[str, str]] = []
    name = (
        f"{model.source}={env.get(model.source)}"
        if model.source in env
        else f"model folder {model.source}"
        if model.source != "default"
        else "no model named, no SageMaker model folder"
    )
    what = f"--model {model.model}"
    if model.s3_uri:
        what += " (downloaded from S3 with boto3 before vLLM starts)"
    elif model.source == "default":
        what += " (the generated test model)"
    out.append((name, f"{what}; served as {engine.served_model_name!r}"))
    args = dict(_pairs(engine.vllm_args))
    for flag, var in engine.arg_sources:
        if flag == "--model":
            continue
        value = args.get(flag, args.get("--no-" + flag[2:], ""))
        shown = "***" if flag in ("--hf-token", "--api-key") else str(env.get(var, ""))
        out.append((f"{var}={shown}", _rendered(flag, value) if value != "" else flag))
    for var, what, render in HTTP_VARIABLES:
        if var in env:
            out.append((f"{var}={env[var]}", f"{what} {render(http)}"))
        elif var in SHOWN_DEFAULTS:
            out.append((f"{var} (default)", f"{what} {render(http)}"))
    for key, value in engine.env:
        why = "SAGEMAKER_SAFE_PORT_RANGE" if key == "VLLM_PORT" else f"{key} (default)"
        out.append((f"{why}={env[why]}" if why in env else why, f"engine processes get {key}={value}"))
    for var in sorted(k for k in env if k.startswith("KVCACHE_")):
        shown = "***" if var == "KVCACHE_SIGNING_KEY" else env[var]
        out.append((f"{var}={shown}", "the KV cache tiers (plan below)"))
    return tuple(out)


def _pairs(args: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            yield args[i], args[i + 1]
            i += 2
        else:
            yield args[i], "true"
            i += 1
