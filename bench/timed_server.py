"""``python -m bench.timed_server``: ``python -m serving`` with a bench connector in place of
ours: ``bench.timed_connector`` (its timings appended to ``$KVBENCH_TIMING_LOG``, JSON
lines), or with ``KVBENCH_CONNECTOR=off``, ``nosave``, ``copyonly`` or ``nocopydown`` one of
``bench.off_connector``'s (ours with parts switched off).

Runs as the server's main process, like ``python -m serving``; only the connector class in
vLLM's ``--kv-transfer-config`` differs (the subclass), so every process vLLM starts
loads it. Used by ``bench.low_load`` (``--timings``; configurations ``ours-off``,
``ours-nosave``, ``ours-copyonly``, ``ours-nocopydown``); not part of the product.
"""

from __future__ import annotations

import os
import runpy

import serving.config

# KVBENCH_CONNECTOR: (class, module)
CONNECTORS = {
    "timed": ("TimedTieredKVConnector", "bench.timed_connector"),
    "off": ("OffTieredKVConnector", "bench.off_connector"),
    "nosave": ("NoSaveTieredKVConnector", "bench.off_connector"),
    "copyonly": ("CopyOnlyTieredKVConnector", "bench.off_connector"),
    "nocopydown": ("NoCopyDownTieredKVConnector", "bench.off_connector"),
}


def swapped_config(kv_transfer_config, which: str):
    name, module = CONNECTORS[which]

    def swapped(config) -> dict:
        kv = kv_transfer_config(config)
        kv["kv_connector"] = name
        kv["kv_connector_module_path"] = module
        if which == "timed":
            kv["kv_connector_extra_config"]["timing_log"] = os.environ["KVBENCH_TIMING_LOG"]
        return kv

    return swapped


if __name__ == "__main__":
    which = os.environ.get("KVBENCH_CONNECTOR", "timed")
    serving.config.kv_transfer_config = swapped_config(serving.config.kv_transfer_config, which)
    runpy.run_module("serving", run_name="__main__", alter_sys=True)
