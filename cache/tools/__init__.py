"""Offline command-line tools over the cache: ``python -m cache.tools.<name>``.

``footprint`` (KV bytes of a model and what tier sizes hold) and ``warm`` (publish the KV
of given prompts to the shared tier). They run in their own processes, never inside a
serving engine.
"""
