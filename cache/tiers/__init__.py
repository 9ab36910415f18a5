"""Tiers: one class per kind of storage behind the protocol in ``base``.

``memory`` (a dict, for tests), ``files`` (a local folder: the DRAM tier on tmpfs, the disk
tier on NVMe), ``shared`` (L3, a folder every node sees) with its ``resilience`` (deadline,
breaker, pacer) and ``transport`` (fsspec / Curvine); ``layout`` names the files of
every tier. ``cache.assembly`` builds them from the configuration. This package imports
nothing, so ``cache.config`` may read ``layout`` without pulling the tiers in.
"""
