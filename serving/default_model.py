"""A small Llama-architecture model generated offline, so the server and tests run anywhere.

Runs once, at start-up or in a test fixture, in the calling process. Nothing is
downloaded: the weights are random (seeded, so every machine generates the same model),
the tokenizer is byte-level (256 byte tokens plus BOS/EOS), and a minimal chat template
makes the chat routes work. Random weights often repeat one token: compare logprobs,
not text.

    python -m serving.default_model DIR [--layers N --hidden N --heads N --kv-heads N]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the generated model; the defaults keep CPU tests quick."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    max_positions: int = 16384
    seed: int = 0


def _byte_vocab() -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    return {ch: i for i, ch in enumerate(alphabet)}


def build_tokenizer(out: Path) -> int:
    """Write a byte-level BPE tokenizer (no merges) to ``out``; returns vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _byte_vocab()
    vocab["<s>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(vocab)


def ensure_model(path: str | os.PathLike, shape: ModelShape = ModelShape()) -> Path:
    """Generate the model at ``path`` unless an identical one is already there.

    Safe to call from several processes (see ``ensure_generated``).
    """

    def build(tmp: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        vocab_size = build_tokenizer(tmp)
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            max_position_embeddings=shape.max_positions,
            bos_token_id=vocab_size - 2,
            eos_token_id=vocab_size - 1,
            torch_dtype="bfloat16",
            tie_word_embeddings=False,
        )
        torch.manual_seed(shape.seed)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)

    return ensure_generated(path, {"generator": "serving.default_model", **asdict(shape)}, build)


def ensure_generated(path: str | os.PathLike, wanted: dict, build: Callable[[Path], None]) -> Path:
    """Run ``build(folder)`` to generate a model at ``path`` unless the one there was
    generated from the same ``wanted`` description (kept in ``generated_by.json``).

    Safe to call from several processes: the model is built in a temporary folder
    and renamed into place.
    """
    out = Path(path)
    marker = out / "generated_by.json"
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    build(tmp)
    (tmp / "generated_by.json").write_text(json.dumps(wanted))
    if out.exists():
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    try:
        os.rename(tmp, out)
    except OSError:  # another process won the race with the same model
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    for field, default in asdict(ModelShape()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    args = vars(p.parse_args())
    path = args.pop("path")
    print(ensure_model(path, ModelShape(**args)))


if __name__ == "__main__":
    main()
