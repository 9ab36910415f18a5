"""The errors a caller outside the module that raises them catches: a leaf, imports nothing.

Each names what was wrong so that its message can be shown as it is: to an operator at
start-up (``ConfigError``, ``FootprintError``: the server exits 2 with the message) or to
a client as a 400 (``ParamsError``, ``PinError``). They live here, below every module
that raises them, so that any package may raise or catch them without importing
``cache.config`` (which would tie, e.g., ``cache.tiers`` back to the configuration).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad setting; the message names the variable and what would fix it."""


class FootprintError(ValueError):
    """The config does not say enough to size its KV cache."""


class ParamsError(ValueError):
    """``kv_transfer_params`` this connector does not read (a client mistake)."""


class PinError(ValueError):
    """A pin request that is not one (a client mistake)."""
