"""``python -m bench.timed_server``: ``python -m serving`` with ``bench.timed_connector`` in
place of ours, its timings appended to ``$KVBENCH_TIMING_LOG`` (JSON lines).

Runs as the server's main process, like ``python -m serving``; only the connector class in
vLLM's ``--kv-transfer-config`` differs (the timed subclass), so every process vLLM starts
loads it. Used by ``bench.low_load --timings``; not part of the product.
"""

from __future__ import annotations

import os
import runpy

import serving.config


def _timed(kv_transfer_config):
    def timed(config) -> dict:
        kv = kv_transfer_config(config)
        kv["kv_connector"] = "TimedTieredKVConnector"
        kv["kv_connector_module_path"] = "bench.timed_connector"
        kv["kv_connector_extra_config"]["timing_log"] = os.environ["KVBENCH_TIMING_LOG"]
        return kv

    return timed


if __name__ == "__main__":
    serving.config.kv_transfer_config = _timed(serving.config.kv_transfer_config)
    runpy.run_module("serving", run_name="__main__", alter_sys=True)
