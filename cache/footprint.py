"""KV footprint of a model: bytes of KV per token and per request, from its ``config.json``.

Pure arithmetic on a Hugging Face config (no torch, no vLLM); runs wherever it is
called: at server start-up (``serving.sizing`` turns tier sizes into token counts
with it) and by the command-line tool ``python -m cache.tools.footprint``.

Layouts:
- multi-head / grouped-query / multi-query attention: K and V per layer,
  ``layers x kv_heads x head_dim x 2 x dtype bytes`` per token;
- DeepSeek multi-head latent attention (MLA): one compressed latent per layer,
  ``layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes`` per token.

Hybrid models (``cache.layer_kinds``): only full-attention layers keep KV for every token
(``bytes_per_token``); a sliding-window layer keeps its last ``window`` tokens, a Mamba /
linear-attention layer a fixed state, both per request (``bytes_per_request``), as vLLM's
hybrid KV cache manager holds them. ``full_layout_bytes_per_token`` is what every
attention layer would take keeping every token (the hybrid manager off).

The dtype is the KV cache dtype: the model's own (``torch_dtype``) unless a
``--kv-cache-dtype`` such as ``fp8`` overrides it. A float32 checkpoint counts as 2
bytes, because vLLM's ``--dtype auto`` serves it in 16 bits.

Llama 3 70B (80 layers, 8 KV heads, head dim 128, bf16): 327,680 bytes per token,
42,949,672,960 bytes (40 GiB) for one 131,072-token request.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from cache.errors import FootprintError
from cache.layer_kinds import layer_kinds
from cache.sizes import human_bytes

_DTYPE_BYTES = {
    "float32": 2,  # served in 16 bits by vLLM's --dtype auto
    "float": 2,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class KVFootprint:
    model_type: str
    attention: str  # "mha", "gqa", "mqa" or "mla"
    layers: int  # layers keeping KV for every token (full attention)
    kv_heads: int  # 1 for MLA (one latent per layer)
    head_dim: int  # per KV head; for MLA kv_lora_rank + qk_rope_head_dim
    tensors: int  # 2 (K and V) or 1 (MLA latent)
    dtype: str
    dtype_bytes: int
    max_context: Optional[int] = None
    window_layers: int = 0  # sliding-window layers: KV of their last ``window`` tokens
    window: Optional[int] = None
    state_layers: int = 0  # Mamba / linear-attention layers: a state per request
    state_bytes: int = 0  # that state, all those layers together

    @property
    def layer_bytes_per_token(self) -> int:
        """KV bytes of one attention layer for one token."""
        return self.kv_heads * self.head_dim * self.tensors * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes every further token adds (full-attention layers)."""
        return self.layers * self.layer_bytes_per_token

    @property
    def window_bytes_per_token(self) -> int:
        return self.window_layers * self.layer_bytes_per_token

    @property
    def full_layout_bytes_per_token(self) -> int:
        """Bytes per token if every attention layer kept every token."""
        return (self.layers + self.window_layers) * self.layer_bytes_per_token

    @property
    def hybrid(self) -> bool:
        return bool(self.window_layers or self.state_layers)

    def bytes_per_request(self, tokens: int) -> int:
        window = min(tokens, self.window or 0)
        return self.bytes_per_token * tokens + self.window_bytes_per_token * window + self.state_bytes

    def tokens_in(self, nbytes: int, context: Optional[int] = None) -> int:
        """Tokens of KV that ``nbytes`` hold: for a hybrid model, in requests of
        ``context`` tokens (default: the model's longest), each with its window and state."""
        if not self.hybrid:
            return nbytes // self.bytes_per_token
        ctx = context or self.max_context or 1
        return nbytes * ctx // max(1, self.bytes_per_request(ctx))

    def requests_in(self, nbytes: int, tokens: int) -> int:
        """Whole requests of ``tokens`` tokens that ``nbytes`` hold."""
        return nbytes // self.bytes_per_request(tokens) if tokens > 0 else 0

    def describe(self) -> str:
        if self.attention == "mla":
            shape = f"{self.layers} layers x {self.head_dim}-wide MLA latent"
        else:
            shape = f"{self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} dims x 2 (K,V)"
        text = (
            f"{self.model_type} ({self.attention.upper()}): {shape} x {self.dtype_bytes} "
            f"bytes ({self.dtype}) = {self.bytes_per_token:,} bytes "
            f"({human_bytes(self.bytes_per_token)}) per token"
        )
        if self.window_layers:
            text += (
                f"; plus {self.window_layers} sliding-window layers: "
                f"{human_bytes(self.window_bytes_per_token)} per token of their "
                f"{self.window:,}-token window"
            )
        if self.state_layers:
            text += f"; plus {self.state_layers} Mamba/linear layers: {human_bytes(self.state_bytes)} of state"
        if self.hybrid:
            text += " per request"
        return text


def _first(cfg: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        value = cfg.get(name)
        if value is not None:
            return value
    return None


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: multimodal configs nest it (``text_config``)."""
    for key in ("text_config", "language_config", "llm_config"):
        inner = cfg.get(key)
        if isinstance(inner, Mapping) and _first(inner, "num_hidden_layers", "n_layer", "num_layers"):
            merged = dict(inner)
            for k in ("torch_dtype", "dtype"):  # the outer config often carries the dtype
                if merged.get(k) is None and cfg.get(k) is not None:
                    merged[k] = cfg[k]
            return merged
    return cfg


def dtype_bytes(dtype: str) -> int:
    key = str(dtype).lower().replace("torch.", "")
    if key not in _DTYPE_BYTES:
        raise FootprintError(f"unknown KV dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


def footprint_from_config(config: Mapping[str, Any], kv_dtype: Optional[str] = None) -> KVFootprint:
    """The KV footprint of the model a Hugging Face ``config.json`` describes.

    ``kv_dtype`` is vLLM's ``--kv-cache-dtype``; None or ``"auto"`` means the model's dtype.
    """
    cfg = _text_config(config)
    model_type = str(_first(cfg, "model_type") or config.get("model_type") or "unknown")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    if not layers:
        raise FootprintError("config has no layer count (num_hidden_layers / n_layer / num_layers)")
    model_dtype = str(_first(cfg, "torch_dtype", "dtype") or "bfloat16").replace("torch.", "")
    dtype = model_dtype if kv_dtype in (None, "", "auto") else kv_dtype
    nbytes = dtype_bytes(dtype)
    max_context = _first(cfg, "max_position_embeddings", "n_positions", "seq_length")

    if _first(cfg, "kv_lora_rank") is not None:  # DeepSeek V2/V3 MLA: one latent per layer
        rope = _first(cfg, "qk_rope_head_dim")
        if rope is None:
            raise FootprintError("MLA config has kv_lora_rank but no qk_rope_head_dim")
        return KVFootprint(
            model_type, "mla", int(layers), 1, int(cfg["kv_lora_rank"]) + int(rope), 1, dtype, nbytes, max_context
        )

    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    if not heads:
        raise FootprintError("config has no attention head count (num_attention_heads / n_head)")
    if cfg.get("multi_query") is True:  # Falcon-style multi-query
        kv_heads = 1
    else:
        kv_heads = _first(cfg, "num_key_value_heads", "multi_query_group_num", "n_head_kv", "num_kv_heads") or heads
    head_dim = _first(cfg, "head_dim", "kv_channels")
    if head_dim is None:
        hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
        if not hidden:
            raise FootprintError("config has neither head_dim nor hidden_size")
        head_dim = int(hidden) // int(heads)
    kind = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
    k = layer_kinds(cfg, int(layers))
    return KVFootprint(
        model_type,
        kind,
        k.full,
        int(kv_heads),
        int(head_dim),
        2,
        dtype,
        nbytes,
        max_context,
        k.window,
        k.window_tokens,
        k.state,
        k.state * k.state_values * nbytes,
    )


def load_hf_config(path: str | os.PathLike) -> dict:
    """Read ``config.json`` from a model folder or from the file itself."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    try:
        with open(p) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FootprintError(f"no config.json at {path!r}") from None
    except json.JSONDecodeError as e:
        raise FootprintError(f"{p} is not valid JSON: {e}") from None


def report(fp: KVFootprint, context: int, tiers: Mapping[str, int]) -> dict:
    """Per-token and per-request bytes, and what each tier (name -> bytes) holds."""
    return {
        **asdict(fp),
        "bytes_per_token": fp.bytes_per_token,
        "context_tokens": context,
        "bytes_per_request": fp.bytes_per_request(context),
        "tiers": {
            name: {"bytes": n, "tokens": fp.tokens_in(n, context), "requests": fp.requests_in(n, context)}
            for name, n in tiers.items()
        },
    }
