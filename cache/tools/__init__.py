"""Offline command-line tools over the cache: ``python -m cache.tools.<name>``.

``footprint`` (KV bytes of a model and what tier sizes hold), ``warm`` (publish the KV
of given prompts to the shared tier), ``inspect`` (what a tier holds), ``replay`` (a
policy's token hit ratio on a trace or a seeded workload, ``trace`` and ``workloads``).
They run in their own processes, never inside a serving engine.
"""
