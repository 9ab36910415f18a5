"""The weights' fingerprint (``cache.weights``) and where it goes: the namespace of every
process (``cache.vllm.namespace``), taken once by the server (``serving.weights``), and
LoRA adapters told apart by content (``Salts``). What it reads is counted, not timed."""

from __future__ import annotations

import json
import os
import shutil
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cache.weights import GENERIC_PIECES, HEAD_BYTES, MIN_PIECE, PIECE, SAMPLE_BUDGET, fingerprint

GB = 10**9


def shard(path, seed: int, names=("a.weight", "b.weight", "norm.weight"), rows=512) -> None:
    """A safetensors file of bfloat16-sized (uint16) random tensors."""
    rng = np.random.default_rng(seed)
    tensors = {n: rng.integers(0, 2**16, (rows if n != "norm.weight" else 1, 1024), dtype=np.uint16) for n in names}
    save_file(tensors, str(path))


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shard(folder / "model-00001-of-00002.safetensors", 1)
    shard(folder / "model-00002-of-00002.safetensors", 2, names=("c.weight", "d.weight"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    (folder / "config.json").write_text("{}")
    return folder


def rewrite(path, name, change) -> None:
    tensors = load_file(str(path))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(path))


def test_a_fine_tuned_tensor_changes_it_a_moved_folder_does_not(model, tmp_path):
    fp = fingerprint(str(model))
    assert fp.files == 2 and len(fp.digest) == 32
    assert fingerprint(str(model)) == fp
    moved = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(model, moved)
    assert fingerprint(str(moved)).digest == fp.digest
    # a fine-tune of one matrix: every value moves a little (same shape, dtype, header)
    shard_1 = moved / "model-00001-of-00002.safetensors"
    rewrite(shard_1, "b.weight", lambda t: t ^ np.uint16(1))
    assert fingerprint(str(moved)).digest != fp.digest


def test_a_merged_low_rank_update_changes_it(model):
    """A LoRA merged into one matrix: ``W + B @ A``, dense over the whole matrix."""
    before = fingerprint(str(model)).digest
    rng = np.random.default_rng(7)
    delta = (rng.integers(0, 4, (512, 2)) @ rng.integers(0, 4, (2, 1024))).astype(np.uint16)
    rewrite(model / "model-00002-of-00002.safetensors", "d.weight", lambda t: t + delta)
    assert fingerprint(str(model)).digest != before


def test_other_files_count_too(model):
    before = fingerprint(str(model)).digest
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "y"}}))
    assert fingerprint(str(model)).digest != before
    (model / "config.json").write_text('{"other": 1}')  # the config is in the namespace already
    (model / "tokenizer.json").write_text("{}")
    after_index = fingerprint(str(model)).digest
    (model / "README.md").write_text("notes")
    assert fingerprint(str(model)).digest == after_index


def test_sampled_can_miss_one_value_full_cannot(model):
    """The honest limit: a change confined to bytes the sample does not read. A tensor
    larger than its piece has its first or its last byte outside the piece."""
    path = model / "model-00001-of-00002.safetensors"
    sampled, full = fingerprint(str(model)).digest, fingerprint(str(model), "full")
    assert full.bytes_read >= full.total_bytes
    missed = False
    for where in (0, -1):
        copy = load_file(str(path))
        flat = copy["a.weight"].reshape(-1)
        flat[where] ^= 1
        save_file(copy, str(path))
        missed |= fingerprint(str(model)).digest == sampled
        assert fingerprint(str(model), "full").digest != full.digest
        flat[where] ^= 1
        save_file(copy, str(path))
    assert missed


def sparse_safetensors(path, size: int, tensors: int) -> int:
    """A safetensors file of ``size`` bytes (sparse: no blocks written) holding ``tensors``
    tensors over its whole data; returns the header's length."""
    header = {}
    n = 0
    while True:
        raw = json.dumps(header).encode()
        data = size - 8 - len(raw)
        each = data // tensors
        header = {
            f"model.layers.{i // 9}.w{i % 9}": {
                "dtype": "BF16",
                "shape": [each // 2],
                "data_offsets": [i * each, (i + 1) * each],
            }
            for i in range(tensors)
        }
        if len(json.dumps(header).encode()) == n:
            break
        n = len(json.dumps(header).encode())
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(size)
    return len(raw)


def test_a_100_gb_model_costs_a_few_mib_read(tmp_path):
    """Counted, not timed: 5 shards of 20 GB, 720 tensors (an 80-layer model)."""
    folder = tmp_path / "big"
    folder.mkdir()
    headers = sum(sparse_safetensors(folder / f"model-{i}.safetensors", 20 * GB, 144) + 8 for i in range(5))
    fp = fingerprint(str(folder))
    assert fp.total_bytes == 100 * GB
    assert fp.bytes_read <= headers + SAMPLE_BUDGET, fp.describe()
    # very many small tensors: MIN_PIECE each, at most
    many = tmp_path / "many"
    many.mkdir()
    headers = sparse_safetensors(many / "model.safetensors", 2 * GB, 60000) + 8
    assert fingerprint(str(many)).bytes_read <= headers + 60000 * MIN_PIECE


def test_other_formats_are_sampled_over_every_file(tmp_path):
    """Pickled (.bin) and GGUF weights: read as plain bytes, a bounded number of pieces."""
    folder = tmp_path / "bins"
    folder.mkdir()
    for i in range(4):
        with open(folder / f"pytorch_model-{i}.bin", "wb") as f:
            f.write(os.urandom(HEAD_BYTES))
            f.truncate(25 * GB)
    fp = fingerprint(str(folder))
    assert fp.total_bytes == 100 * GB and fp.files == 4
    assert fp.bytes_read <= 4 * (HEAD_BYTES + 2 * PIECE) + GENERIC_PIECES * PIECE, fp.describe()
    small = tmp_path / "gguf"
    small.mkdir()
    data = bytearray(os.urandom(64 << 20))
    (small / "model.gguf").write_bytes(data)
    before = fingerprint(str(small)).digest
    data[(32 << 20) : (33 << 20)] = os.urandom(1 << 20)  # one MiB rewritten, mid-file
    (small / "model.gguf").write_bytes(data)
    assert fingerprint(str(small)).digest != before
    assert fingerprint(str(small / "model.gguf")).digest == fingerprint(str(small)).digest  # one file


def test_a_hub_snapshot_adds_its_commit(model, tmp_path):
    snaps = tmp_path / "models--org--m" / "snapshots"
    for commit in ("a" * 40, "b" * 40):
        shutil.copytree(model, snaps / commit)
    assert fingerprint(str(snaps / ("a" * 40))).digest != fingerprint(str(snaps / ("b" * 40))).digest


def test_an_unknown_mode_is_refused(model):
    with pytest.raises(ValueError, match="sampled, full"):
        fingerprint(str(model), "none")


# -- where it goes ---------------------------------------------------------------------------
def fake_engine(path: str):
    """The parts of ``VllmConfig``/``KVCacheConfig`` ``engine_namespace`` reads."""
    model = SimpleNamespace(model=path, revision=None, quantization=None, hf_config={"a": 1})
    vllm = SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        load_config=SimpleNamespace(download_dir=None),
    )
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec="spec", layer_names=["l0"])])
    return vllm, kv


def test_every_namespace_holds_the_weights(model, tmp_path):
    from cache.config import CacheConfig
    from cache.vllm.namespace import engine_namespace, weights_id

    vllm, kv = fake_engine(str(model))
    ours = weights_id(vllm, CacheConfig())
    assert ours == fingerprint(str(model)).digest
    assert weights_id(vllm, CacheConfig(weights_fingerprint="f" * 32)) == "f" * 32  # the server's
    a = engine_namespace(vllm, kv, 256, 0, weights=ours)
    b = engine_namespace(vllm, kv, 256, 0, weights="f" * 32)
    assert a.model == b.model and a.id != b.id and a.chain_digest != b.chain_digest


def test_the_server_takes_it_once_for_every_process(model):
    from cache.config import CacheConfig
    from cache.vllm import kv_transfer_config
    from serving.config import EngineSettings
    from serving.weights import with_weights_fingerprint

    def settings(cache):
        return EngineSettings(
            vllm_args=("--model", str(model), "--kv-transfer-config", json.dumps(kv_transfer_config(cache)))
        )

    def taken(out):
        return json.loads(out.vllm_args[3])["kv_connector_extra_config"]["kvcache_config"]["weights_fingerprint"]

    assert taken(with_weights_fingerprint(settings(CacheConfig()))) == fingerprint(str(model)).digest
    full = with_weights_fingerprint(settings(CacheConfig(weights_hash="full")))
    assert taken(full) == fingerprint(str(model), "full").digest
    hub = EngineSettings(
        vllm_args=("--model", "org/name", "--kv-transfer-config", json.dumps(kv_transfer_config(CacheConfig())))
    )
    assert with_weights_fingerprint(hub) == hub  # not on disk yet: each process takes it


def lora(path, name="adapter", int_id=1):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, str(path))


def test_lora_adapters_are_told_apart_by_content_not_name(tmp_path):
    from cache.vllm.namespace import Salts

    for name, seed in (("one", 1), ("two", 2), ("copy", 1)):
        (tmp_path / name).mkdir()
        shard(tmp_path / name / "adapter_model.safetensors", seed, names=("lora_A", "lora_B"), rows=8)
        (tmp_path / name / "adapter_config.json").write_text('{"r": 8}')
    salts = Salts()
    req = lambda path, name: SimpleNamespace(lora_request=lora(path, name), cache_salt=None)  # noqa: E731
    one, two = salts(req(tmp_path / "one", "same-name")), salts(req(tmp_path / "two", "same-name"))
    assert one and one != two  # one name, two adapters
    assert salts(req(tmp_path / "copy", "other-name")) == one  # one adapter, two names
    assert salts(SimpleNamespace(lora_request=None, cache_salt=None)) == ""
    # taken once per adapter: its files are not read again
    (tmp_path / "one" / "adapter_config.json").write_text('{"r": 16}')
    assert salts(req(tmp_path / "one", "same-name")) == one
