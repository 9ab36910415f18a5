"""The tiered KV cache: keep the KV of prompt prefixes below the GPU and load it back.

Runtime library (``config``, ``keys``, ``codec``, ``tiers``, ``store``, ``assembly`` ...,
no vLLM), the vLLM adapter (``cache.vllm``) and offline tools (``cache.tools``). See the
README's "Layout" section for the map.
"""
