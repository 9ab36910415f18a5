"""Offline command-line tools over the cache's core (``python -m cache.tools.NAME``)."""
