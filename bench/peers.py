"""The KV connectors the TTFT benchmark compares, and LMCache's cache server.

Runs in the benchmark's parent process: builds each engine's ``kv_transfer_config``
(ours, LMCache's multiprocess connector, vLLM's in-tree ExampleConnector) and starts
and stops the ``lmcache server`` process that LMCache's connector talks to.

LMCache runs here in one mode only (see docs in GUIDE): ``LMCacheMPConnector`` in
vLLM, ``engine_driven`` transfers, against its own server process holding an L1 (DRAM)
and optionally an ``fs`` L2 (disk) folder; it needs ``PYTHONHASHSEED=0`` in the engine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

# Set for every engine of the benchmark:
# - PYTHONHASHSEED: LMCache's chunk hashes need it (harmless elsewhere);
# - VLLM_CPU_NUM_OF_RESERVED_CPU=1: vLLM's CPU build reserves one more core whenever a KV
#   connector is configured (any connector, "for nixl"); on a 2-core machine that leaves
#   nothing to reserve, so it binds the worker to both cores instead of one. Without
#   this, an engine with a connector and one without get different CPU layouts and
#   the no-reuse throughput compares the layouts, not the connector.
ENGINE_ENV = {"PYTHONHASHSEED": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def ours(dram_path: str, dram_size: str, disk_path: str, disk_size: str, chunk_tokens: int = 256, **more: str) -> dict:
    """kv_transfer_config fields for our TieredKVConnector ("0" disables a tier), its
    configuration resolved here, once, as the server does; ``more``: further settings by
    their names without ``KVCACHE_``, in lower case (``shared_url=...``)."""
    from cache.config import build_cache_config
    from cache.vllm import kv_transfer_config

    settings = {
        "KVCACHE_DRAM_PATH": dram_path,
        "KVCACHE_DRAM_SIZE": dram_size,
        "KVCACHE_DISK_PATH": disk_path,
        "KVCACHE_DISK_SIZE": disk_size,
        "KVCACHE_CHUNK_TOKENS": str(chunk_tokens),
        **{f"KVCACHE_{k.upper()}": v for k, v in more.items()},
    }
    return kv_transfer_config(build_cache_config(settings))


def lmcache(port: int) -> dict:
    """kv_transfer_config fields for LMCache's multiprocess connector."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
            "lmcache.mp.mp_transfer_mode": "engine_driven",
        },
    }


def example(storage_path: str) -> dict:
    """kv_transfer_config fields for vLLM's ExampleConnector (safetensors per layer)."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }


def lmcache_available() -> Optional[str]:
    """None if LMCache can run here, else the reason it cannot."""
    exe = shutil.which("lmcache", path=os.path.dirname(sys.executable))
    if exe is None:
        return (
            "the `lmcache` command is not in this venv: pip install lmcache==0.5.6 --no-deps "
            "sortedcontainers aiofile aiofiles redis"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LMCacheServer:
    """``lmcache server`` in its own process group; ``stop`` ends the whole group."""

    def __init__(self, log_path: str, l1_gb: float, l2_dir: Optional[str] = None, chunk_tokens: int = 256) -> None:
        self.port = free_port()
        exe = shutil.which("lmcache", path=os.path.dirname(sys.executable))
        cmd = [
            exe,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--chunk-size",
            str(chunk_tokens),
            "--l1-size-gb",
            str(l1_gb),
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "engine_driven",
            # Its HTTP admin API defaults to 8080: keep clear of anything else on the
            # machine. Observability off: its OTel metrics need a Prometheus exporter
            # that is not installed, and it is overhead we do not measure.
            "--http-port",
            str(free_port()),
            "--disable-observability",
        ]
        if l2_dir:
            os.makedirs(l2_dir, exist_ok=True)
            cmd += ["--l2-adapter", json.dumps({"type": "fs", "base_path": l2_dir})]
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = {**os.environ, **ENGINE_ENV, "LMCACHE_DISABLE_BANNER": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_listening(timeout=120)

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"lmcache server did not listen on {self.port}; see {self.log_path}")

    def stop(self) -> None:
        kill_group(self.proc)
        self._log.close()


def kill_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group ``proc`` leads, then SIGKILL whatever is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
