"""Small random-weight hybrid models, generated offline for the engine tests.

Runs in the test process (a session fixture), once per machine: each model is kept
under ``.models/`` next to the test Llama and regenerated only when its description
changes. The byte-level tokenizer is the default model's (``serving.default_model``).

- ``ensure_gemma3``: a Gemma 3 text model whose layers mix ``sliding_attention`` and
  ``full_attention`` (vLLM groups them into sliding-window and full-attention KV cache
  groups under its hybrid KV cache manager).
- ``ensure_ssm_hybrid``: a Granite 4 (dense) hybrid (Mamba-2 layers beside attention
  layers), which vLLM serves with per-request SSM state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from serving.default_model import build_tokenizer, ensure_generated

# the attention dimensions both models share with the test Llama
ATTENTION = {"hidden": 256, "heads": 4, "kv_heads": 2, "max_positions": 16384, "seed": 0}
GEMMA3 = {
    **ATTENTION,
    "layers": ["sliding_attention"] * 3 + ["full_attention"],
    "sliding_window": 256,
    "head_dim": 64,
    "intermediate": 512,
}
GRANITE4 = {
    **ATTENTION,
    "layers": ["linear_attention", "full_attention"] * 2,
    "shared_intermediate": 512,
    "mamba_heads": 8,
    "mamba_head_dim": 64,
    "mamba_state": 16,
}


def _ensure(path: str | Path, name: str, shape: dict, model_of: Callable[[int], Any]) -> Path:
    """Generate (once) the model ``model_of(vocab_size)`` returns, in bfloat16, seeded."""

    def build(tmp: Path) -> None:
        import torch

        vocab = build_tokenizer(tmp)
        torch.manual_seed(shape["seed"])
        model_of(vocab).to(torch.bfloat16).save_pretrained(tmp)

    return ensure_generated(path, {"generator": f"tests.hybrid_models.{name}", **shape}, build)


def _tokens(vocab: int) -> dict:
    return {
        "vocab_size": vocab,
        "bos_token_id": vocab - 2,
        "eos_token_id": vocab - 1,
        "pad_token_id": vocab - 1,
        "torch_dtype": "bfloat16",
    }


def ensure_gemma3(path: str | Path, shape: dict = GEMMA3) -> Path:
    def model_of(vocab: int):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(
            Gemma3TextConfig(
                hidden_size=shape["hidden"],
                intermediate_size=shape["intermediate"],
                num_hidden_layers=len(shape["layers"]),
                layer_types=list(shape["layers"]),
                num_attention_heads=shape["heads"],
                num_key_value_heads=shape["kv_heads"],
                head_dim=shape["head_dim"],
                query_pre_attn_scalar=shape["head_dim"],
                sliding_window=shape["sliding_window"],
                max_position_embeddings=shape["max_positions"],
                tie_word_embeddings=True,
                **_tokens(vocab),
            )
        )

    return _ensure(path, "gemma3", shape, model_of)


def ensure_ssm_hybrid(path: str | Path, shape: dict = GRANITE4) -> Path:
    def model_of(vocab: int):
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        return GraniteMoeHybridForCausalLM(
            GraniteMoeHybridConfig(
                hidden_size=shape["hidden"],
                num_hidden_layers=len(shape["layers"]),
                layer_types=list(shape["layers"]),
                num_local_experts=0,
                shared_intermediate_size=shape["shared_intermediate"],
                num_attention_heads=shape["heads"],
                num_key_value_heads=shape["kv_heads"],
                mamba_n_heads=shape["mamba_heads"],
                mamba_d_head=shape["mamba_head_dim"],
                mamba_d_state=shape["mamba_state"],
                mamba_expand=2,
                mamba_n_groups=1,
                max_position_embeddings=shape["max_positions"],
                position_embedding_type="rope",
                tie_word_embeddings=False,
                **_tokens(vocab),
            )
        )

    return _ensure(path, "granite4", shape, model_of)
