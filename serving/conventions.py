"""The settings AWS's own LLM containers take, translated to ``vllm serve`` arguments.

Runs once at start-up in the server process (``serving.config``); pure functions over
the environment, nothing blocks. A user who swaps only the image URI keeps their
settings; each becomes a vLLM argument, remembering the variable that set it (so an
error names it, and ``--print-config`` shows it), lowest precedence first:

- TGI (Hugging Face's container): ``HF_MODEL_QUANTIZE`` -> ``--quantization``,
  ``HF_MODEL_TRUST_REMOTE_CODE`` -> ``--trust-remote-code``, ``MAX_TOTAL_TOKENS`` ->
  ``--max-model-len``, ``MAX_BATCH_PREFILL_TOKENS`` -> ``--max-num-batched-tokens``,
  ``MAX_INPUT_LENGTH`` checked against ``MAX_TOTAL_TOKENS`` (vLLM bounds prompt plus
  output by ``--max-model-len``; it has no separate prompt bound);
- LMI (DJL): ``OPTION_<ARG>`` -> ``--<arg>``, LMI's names translated
  (``OPTION_TENSOR_PARALLEL_DEGREE`` ...), ``OPTION_DTYPE=fp16|bf16|fp32`` -> vLLM's
  ``float16|bfloat16|float32``, LMI-only options ignored with a note; the model folder's
  ``serving.properties`` (``option.<arg>=value`` lines) counts as ``OPTION_<ARG>`` where
  the environment does not set it. An ``OPTION_*`` that vLLM does not know is dropped
  with a logged note when vLLM's parser runs (``serving.engine_args``), not an error;
- the SageMaker vLLM container: ``SM_VLLM_<ARG>`` -> ``--<arg>`` (``true`` -> a bare
  flag, ``false`` -> ``--no-<arg>``): wins over both, and is checked by vLLM's parser.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from cache.errors import ConfigError

# LMI (DJL) option names that differ from vLLM's; None: an LMI-only setting, ignored.
LMI_ALIASES: dict[str, Optional[str]] = {
    "tensor_parallel_degree": "tensor_parallel_size",
    "pipeline_parallel_degree": "pipeline_parallel_size",
    "max_rolling_batch_size": "max_num_seqs",
    "max_rolling_batch_prefill_tokens": "max_num_batched_tokens",
    "rolling_batch": None,
    "entrypoint": None,
    "async_mode": None,
    "model_loading_timeout": None,
    "output_formatter": None,
    "engine": None,
    "mpi_mode": None,
}
LMI_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# TGI's --quantize values that vLLM names differently (others pass through to vLLM's parser).
TGI_QUANTIZE = {"bitsandbytes-nf4": "bitsandbytes", "bitsandbytes-fp4": "bitsandbytes"}
TGI_SETTINGS = {
    "HF_MODEL_QUANTIZE": "--quantization",
    "HF_MODEL_TRUST_REMOTE_CODE": "--trust-remote-code",
    "MAX_TOTAL_TOKENS": "--max-model-len",
    "MAX_BATCH_PREFILL_TOKENS": "--max-num-batched-tokens",
}
MODEL_OPTIONS = ("OPTION_MODEL_ID", "SM_VLLM_MODEL")  # the model itself: serving.model


def flag(name: str) -> str:
    return "--" + name.strip().lower().replace("_", "-")


def read_serving_properties(model_dir: str) -> dict[str, str]:
    """LMI's ``serving.properties`` in the model folder as ``OPTION_*`` variables."""
    path = os.path.join(model_dir, "serving.properties")
    out: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return out
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ConfigError(f"{path}, line {n}: not a key=value line")
        key = key.strip()
        if key.startswith("option."):
            out["OPTION_" + key[len("option.") :].upper().replace(".", "_")] = value.strip()
        elif key == "engine":
            out["OPTION_ENGINE"] = value.strip()
    return out


def with_serving_properties(env: Mapping[str, str], model_dir: str) -> tuple[dict[str, str], list[str]]:
    """``env`` plus the ``serving.properties`` options it does not set itself."""
    props = read_serving_properties(model_dir)
    merged = dict(env)
    notes = []
    for var, value in props.items():
        if var in env:
            notes.append(f"{var} from the environment wins over serving.properties")
        else:
            merged[var] = value
    if props:
        notes.append(f"read {len(props)} option(s) from {os.path.join(model_dir, 'serving.properties')}")
    return merged, notes


def engine_args(env: Mapping[str, str], gpus: int) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """``--flag -> value`` from TGI's, then LMI's, then SM_VLLM_* settings (later wins),
    the variable that set each flag, and notes."""
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []

    def put(name: str, value: str, var: str) -> None:
        values[name], sources[name] = value, var

    for var, name in TGI_SETTINGS.items():
        value = str(env.get(var) or "").strip()
        if value:
            if var == "HF_MODEL_QUANTIZE":
                value = TGI_QUANTIZE.get(value.lower(), value.lower())
            put(name, value, var)
    _check_tgi_lengths(env, notes)
    for prefix in ("OPTION_", "SM_VLLM_"):
        for var in sorted(k for k in env if k.startswith(prefix)):
            name = var[len(prefix) :].lower()
            value = str(env[var]).strip()
            if not name or var in MODEL_OPTIONS:
                continue
            if prefix == "OPTION_":
                if name in LMI_ALIASES:
                    alias = LMI_ALIASES[name]
                    if alias is None:
                        notes.append(f"{var} is an LMI setting without a vLLM equivalent; ignored")
                        continue
                    name = alias
                if name == "tensor_parallel_size" and value.lower() == "max":
                    value = str(max(1, gpus))
                if name == "dtype":
                    value = LMI_DTYPES.get(value.lower(), value)
            put(flag(name), value, var)
    return values, sources, notes


def _check_tgi_lengths(env: Mapping[str, str], notes: list[str]) -> None:
    raw_in, raw_total = env.get("MAX_INPUT_LENGTH"), env.get("MAX_TOTAL_TOKENS")
    for var, raw in (
        ("MAX_INPUT_LENGTH", raw_in),
        ("MAX_TOTAL_TOKENS", raw_total),
        ("MAX_BATCH_PREFILL_TOKENS", env.get("MAX_BATCH_PREFILL_TOKENS")),
    ):
        if raw and not str(raw).strip().isdigit():
            raise ConfigError(f"{var}={raw!r} must be a positive integer")
    if raw_in and raw_total and int(raw_in) >= int(raw_total):
        raise ConfigError(f"MAX_INPUT_LENGTH={raw_in} must be below MAX_TOTAL_TOKENS={raw_total} (as TGI requires)")
    if raw_in:
        notes.append(
            f"MAX_INPUT_LENGTH={raw_in}: vLLM bounds prompt plus output by "
            "--max-model-len (MAX_TOTAL_TOKENS), not the prompt alone"
        )


def render(args: Mapping[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    for name, value in args.items():
        low = value.lower()
        if low == "true":
            out.append(name)
        elif low == "false":
            out.append("--no-" + name[2:])
        else:
            out += [name, value]
    return tuple(out)
