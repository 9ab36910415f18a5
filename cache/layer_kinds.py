"""Which layers of a model keep KV for every token, only for a sliding window, or a fixed
state per request, read from its Hugging Face ``config.json``.

Pure functions (no torch, no vLLM), called by ``cache.footprint`` wherever it runs. The
conventions covered, first match wins:
- ``layer_types`` (Gemma 2/3, gpt-oss, Cohere 2, Granite 4, Qwen3-Next ...):
  ``sliding_attention`` keeps a window, ``linear_attention`` / ``mamba`` a state, the
  rest every token;
- NemotronH's ``hybrid_override_pattern`` (``M`` Mamba, ``*`` attention), Bamba's
  ``attn_layer_indices``, Jamba's ``attn_layer_period`` / ``attn_layer_offset``,
  Qwen3-Next's ``full_attention_interval``,
  Zamba 2's ``layers_block_type``, Falcon-H1 (attention and Mamba side by side in every
  layer), Mamba / Mamba 2 (no attention);
- a ``sliding_window_pattern`` of *p* (older Gemma 3 configs: every *p*-th layer full),
  or a ``sliding_window`` on every layer (``use_sliding_window``, Mistral).

The state of a Mamba-2 layer is its convolution window ``(d_conv - 1) x (d_inner + 2 x
groups x d_state)`` plus its SSM state ``heads x head_dim x d_state`` values (Mamba-1:
``d_inner x d_state``); of a gated-delta-net layer (Qwen3-Next) ``(kernel - 1) x (2 x
key_heads x key_dim + value_heads x value_dim)`` plus ``value_heads x key_dim x
value_dim``. Counted in the KV dtype (vLLM may keep the SSM state in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

WINDOW_TYPES = {"sliding_attention", "sliding_window", "local_attention", "local"}
STATE_TYPES = {"linear_attention", "mamba", "mamba2", "ssm", "linear"}


@dataclass(frozen=True)
class LayerKinds:
    full: int  # layers whose KV holds every token
    window: int = 0  # layers whose KV holds their last ``window_tokens``
    window_tokens: Optional[int] = None
    state: int = 0  # layers with a fixed state per request
    state_values: int = 0  # values in one such layer's state


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def state_values(cfg: Mapping[str, Any]) -> int:
    """Values in one Mamba / linear-attention layer's per-request state."""
    hidden = int(_get(cfg, "hidden_size", "d_model", default=0))
    if _get(cfg, "linear_num_value_heads") is not None:  # gated delta net (Qwen3-Next)
        kh, vh = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        kd, vd = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        conv = int(_get(cfg, "linear_conv_kernel_dim", default=4)) - 1
        return conv * (2 * kh * kd + vh * vd) + vh * kd * vd
    expand = int(_get(cfg, "mamba_expand", "expand", default=2))
    d_inner = int(_get(cfg, "mamba_d_inner", "mamba_d_ssm", default=expand * hidden))
    d_state = int(_get(cfg, "mamba_d_state", "ssm_state_size", "state_size", default=16))
    d_conv = int(_get(cfg, "mamba_d_conv", "conv_kernel", default=4))
    heads = _get(cfg, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
    if heads is None and cfg.get("model_type") == "mamba2":
        heads = cfg.get("num_heads")
    if heads is None:  # Mamba-1
        return (d_conv - 1) * d_inner + d_inner * d_state
    groups = int(_get(cfg, "mamba_n_groups", "mamba_ngroups", "n_groups", default=1))
    head_dim = int(_get(cfg, "mamba_d_head", "mamba_head_dim", "mamba_headdim", default=d_inner // int(heads)))
    return (d_conv - 1) * (d_inner + 2 * groups * d_state) + int(heads) * head_dim * d_state


def layer_kinds(cfg: Mapping[str, Any], layers: int) -> LayerKinds:
    """How the ``layers`` layers of the (text) config ``cfg`` keep their KV."""
    window = _get(cfg, "sliding_window", "attention_window_size")
    types = _get(cfg, "layer_types", "layers_block_type")
    pattern = cfg.get("hybrid_override_pattern")
    model_type = str(cfg.get("model_type", ""))
    if isinstance(pattern, str) and pattern:  # NemotronH: one character per layer
        return LayerKinds(full=pattern.count("*"), state=pattern.count("M"), state_values=state_values(cfg))
    if model_type in ("mamba", "mamba2", "falcon_mamba"):
        return LayerKinds(full=0, state=layers, state_values=state_values(cfg))
    if model_type == "falcon_h1":  # attention and Mamba in every layer
        return LayerKinds(full=layers, state=layers, state_values=state_values(cfg))
    if isinstance(types, (list, tuple)) and types:
        kinds = [str(t).lower() for t in types]
        n_window = sum(t in WINDOW_TYPES for t in kinds) if window else 0
        n_state = sum(t in STATE_TYPES for t in kinds)
        if model_type == "zamba2":  # "hybrid" layers are Mamba plus a shared attention block
            n_state = len(kinds)
        return LayerKinds(
            full=sum(t not in STATE_TYPES for t in kinds) - n_window,
            window=n_window,
            window_tokens=int(window) if n_window else None,
            state=n_state,
            state_values=state_values(cfg) if n_state else 0,
        )
    attn = cfg.get("attn_layer_indices")
    if attn is None and cfg.get("attn_layer_period"):  # Jamba
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        attn = [i for i in range(layers) if i % period == offset]
    if attn is None and cfg.get("full_attention_interval"):  # Qwen3-Next: every n-th layer full
        attn = list(range(int(cfg["full_attention_interval"]) - 1, layers, int(cfg["full_attention_interval"])))
    if isinstance(attn, (list, tuple)):
        return LayerKinds(full=len(attn), state=layers - len(attn), state_values=state_values(cfg))
    if window and cfg.get("sliding_window_pattern"):  # every p-th layer full (Gemma 3)
        p = int(cfg["sliding_window_pattern"])
        n_full = layers // p
        return LayerKinds(full=n_full, window=layers - n_full, window_tokens=int(window))
    if window and (cfg.get("use_sliding_window") is True or model_type in ("mistral", "mixtral")):
        return LayerKinds(full=0, window=layers, window_tokens=int(window))
    return LayerKinds(full=layers)
