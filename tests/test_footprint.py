"""KV footprint arithmetic (cache.footprint) and its command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cache.errors import FootprintError
from cache.footprint import footprint_from_config, load_hf_config
from cache.tools.footprint import main

LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 163840,
}


@pytest.fixture
def llama_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    return tmp_path


def test_llama3_70b_per_token_and_per_request(llama_dir):
    fp = footprint_from_config(load_hf_config(llama_dir))
    assert (fp.attention, fp.layers, fp.kv_heads, fp.head_dim) == ("gqa", 80, 8, 128)
    assert fp.bytes_per_token == 327_680
    assert fp.bytes_per_request(131_072) == 42_949_672_960
    assert fp.requests_in(100 * 2**30, 131_072) == 2
    assert fp.tokens_in(2**30) == 3276


def test_config_file_path_and_folder_agree(llama_dir):
    assert load_hf_config(llama_dir / "config.json") == load_hf_config(llama_dir)


def test_deepseek_mla_latent():
    fp = footprint_from_config(DEEPSEEK_V3)
    assert fp.attention == "mla" and fp.tensors == 1
    assert fp.bytes_per_token == (512 + 64) * 61 * 2


def test_multi_head_without_kv_head_count():
    cfg = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}
    fp = footprint_from_config(cfg)
    assert fp.attention == "mha"
    assert fp.bytes_per_token == 12 * 12 * 64 * 2 * 2


def test_multi_query():
    cfg = {
        "model_type": "falcon",
        "num_hidden_layers": 32,
        "num_attention_heads": 71,
        "hidden_size": 4544,
        "multi_query": True,
        "torch_dtype": "bfloat16",
    }
    fp = footprint_from_config(cfg)
    assert fp.attention == "mqa" and fp.kv_heads == 1
    assert fp.bytes_per_token == 32 * 64 * 2 * 2


def test_explicit_head_dim_and_nested_text_config():
    cfg = {
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "num_hidden_layers": 34,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2560,
        },
    }
    fp = footprint_from_config(cfg)
    assert fp.bytes_per_token == 34 * 4 * 256 * 2 * 2


def test_kv_cache_dtype_overrides_model_dtype():
    assert footprint_from_config(LLAMA3_70B, "fp8").bytes_per_token == 163_840
    assert footprint_from_config(LLAMA3_70B, "auto").bytes_per_token == 327_680
    f32 = dict(LLAMA3_70B, torch_dtype="float32")  # served in 16 bits by --dtype auto
    assert footprint_from_config(f32).bytes_per_token == 327_680


@pytest.mark.parametrize(
    "cfg",
    [
        {"model_type": "x"},
        {"num_hidden_layers": 2},
        {"num_hidden_layers": 2, "num_attention_heads": 4},
        {"num_hidden_layers": 2, "kv_lora_rank": 4},
    ],
)
def test_incomplete_configs_are_errors(cfg):
    with pytest.raises(FootprintError):
        footprint_from_config(cfg)


def test_unknown_dtype_is_an_error():
    with pytest.raises(FootprintError, match="unknown KV dtype"):
        footprint_from_config(LLAMA3_70B, "int3")


def test_missing_config_is_an_error(tmp_path):
    with pytest.raises(FootprintError, match="no config.json"):
        load_hf_config(tmp_path)


def test_cli_json(llama_dir, capsys):
    assert main([str(llama_dir), "--context", "131072", "--dram-size", "100GiB", "--disk-size", "1TB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 327_680
    assert out["bytes_per_request"] == 42_949_672_960
    assert out["tiers"]["dram"] == {"bytes": 100 * 2**30, "tokens": 327_680, "requests": 2}
    assert out["tiers"]["disk"]["requests"] == 10**12 // 42_949_672_960


def test_cli_text_defaults_to_max_context(llama_dir):
    run = subprocess.run(
        [sys.executable, "-m", "cache.tools.footprint", str(llama_dir / "config.json")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "327,680 bytes" in run.stdout
    assert "one 131,072-token request: 42,949,672,960 bytes (40.0 GiB)" in run.stdout


def test_cli_errors_are_messages(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    assert main([str(tmp_path), "--cpu-size", "lots"]) == 2  # the old flag name still works
    assert "is not a size" in capsys.readouterr().err


# -- hybrid models: windows and states count once per request -------------------------------
GEMMA3_27B = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "hidden_size": 5376,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
}
GPT_OSS_120B = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_size": 2880,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "torch_dtype": "bfloat16",
}
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size": 2048,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "torch_dtype": "bfloat16",
}
NEMOTRON_H = {
    "model_type": "nemotron_h",
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 512,
    "hybrid_override_pattern": "M-M*-M-",
    "mamba_num_heads": 16,
    "mamba_head_dim": 64,
    "n_groups": 2,
    "ssm_state_size": 32,
    "conv_kernel": 4,
    "expand": 2,
    "torch_dtype": "bfloat16",
}


def test_sliding_window_layers_count_only_their_window():
    fp = footprint_from_config(GEMMA3_27B)
    assert (fp.layers, fp.window_layers, fp.window) == (10, 52, 1024)
    assert fp.bytes_per_token == 10 * 16 * 128 * 2 * 2
    assert fp.full_layout_bytes_per_token == 62 * 16 * 128 * 2 * 2
    assert fp.bytes_per_request(131_072) == 81_920 * 131_072 + 52 * 8_192 * 1024
    assert fp.bytes_per_request(500) == 81_920 * 500 + 52 * 8_192 * 500
    assert fp.tokens_in(fp.bytes_per_request(4096) * 3, 4096) == 3 * 4096
    assert "52 sliding-window layers" in fp.describe()
    oss = footprint_from_config(GPT_OSS_120B)
    assert (oss.layers, oss.window_layers, oss.window) == (18, 18, 128)


def test_mamba_and_linear_attention_layers_count_a_state_per_request():
    qwen = footprint_from_config(QWEN3_NEXT)
    assert (qwen.layers, qwen.state_layers) == (12, 36)
    per_layer = 3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128
    assert qwen.state_bytes == 36 * per_layer * 2
    assert qwen.bytes_per_request(1000) == qwen.bytes_per_token * 1000 + qwen.state_bytes
    nemo = footprint_from_config(NEMOTRON_H)
    assert (nemo.layers, nemo.state_layers) == (1, 3)
    d_inner = 2 * 512
    assert nemo.state_bytes == 3 * (3 * (d_inner + 2 * 2 * 32) + 16 * 64 * 32) * 2
    jamba = footprint_from_config(
        {
            "model_type": "jamba",
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 512,
            "attn_layer_period": 8,
            "attn_layer_offset": 4,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        }
    )
    assert (jamba.layers, jamba.state_layers) == (1, 7)
    assert jamba.state_bytes == 7 * (3 * 1024 + 1024 * 16) * 2
