"""The vLLM side of the cache: what the scheduler decides and what the workers copy.

Only this package (and ``cache.vllm.connector``) imports vLLM; the rest of ``cache`` is
engine-agnostic.
"""
