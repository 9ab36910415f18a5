"""Block copies between a paged KV cache and entries, for both block-dimension layouts."""

import pytest
import torch

from cache.vllm.kv_copy import BlockCopier, KVLayout


@pytest.mark.parametrize("shape", [(10, 2, 4, 8), (2, 10, 4, 8), (10, 4, 16)])
def test_gather_scatter_roundtrip(shape):
    num_blocks = 10
    caches = {f"l{i}": torch.randn(shape).to(torch.bfloat16) for i in range(3)}
    layout = KVLayout.of(caches, num_blocks)
    assert layout.block_dim == (1 if shape[0] == 2 else 0)
    copier = BlockCopier(caches, layout)
    entry = copier.gather([7, 2, 5])
    assert tuple(entry.shape) == layout.entry_shape(3)
    bd = layout.block_dim
    for i, name in enumerate(layout.layer_names):
        assert torch.equal(entry[i].select(bd, 1), caches[name].select(bd, 2))

    # scatter into other blocks, skipping the entry's first block
    copier.scatter([0, 9], entry, skip_blocks=1)
    for name in layout.layer_names:
        assert torch.equal(caches[name].select(bd, 0), caches[name].select(bd, 2))
        assert torch.equal(caches[name].select(bd, 9), caches[name].select(bd, 5))
    assert layout.bytes_per_block() * 3 == entry.numel() * entry.element_size()

    # load only the entry's leading blocks (a tail whose last block holds only the
    # prompt's last token, which vLLM computes)
    copier.scatter([4], entry, skip_blocks=1)
    for name in layout.layer_names:
        assert torch.equal(caches[name].select(bd, 4), caches[name].select(bd, 2))


def test_wrong_entry_shape_is_refused():
    caches = {"l0": torch.zeros(4, 2, 3)}
    copier = BlockCopier(caches, KVLayout.of(caches, 4))
    with pytest.raises(ValueError):
        copier.scatter([0, 1], torch.zeros(1, 1, 2, 3))  # one block held, two asked for
    with pytest.raises(ValueError):
        copier.scatter([0], torch.zeros(1, 2, 2, 4))     # foreign block shape


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="block dimension"):
        KVLayout.of({"l0": torch.zeros(3, 3, 3)}, 7)


def test_gpu_copy_checks_pass_on_the_cpu_path():
    """bench.gpu_copy's correctness checks (the ones run on a lent GPU) on the CPU copy
    path; a failed check makes it exit 1. The fence check only bites on CUDA (a CPU
    gather is complete when it returns): bench/results/gpu_copy.md records it failing
    there with ``--skip-fence``."""
    from bench.gpu_copy import main

    assert main(["--layers", "2", "--blocks", "64", "--repeats", "1"]) == 0


@pytest.mark.parametrize("block_ids", [[3, 4, 5, 6, 7, 8], [8, 1, 6, 3, 10, 5], [2, 3, 9, 10, 11, 0]])
@pytest.mark.parametrize("shape", [(12, 2, 4, 8), (2, 12, 4, 8)])
def test_cpu_copies_of_runs_and_scattered_blocks_agree_with_indexing(block_ids, shape):
    """Consecutive blocks are copied as slices, scattered ones (more runs than
    MAX_SLICE_RUNS) by index: both give what indexing the blocks one by one gives."""
    caches = {f"l{i}": torch.randn(shape) for i in range(2)}
    layout = KVLayout.of(caches, 12)
    bd = layout.block_dim
    copier = BlockCopier(caches, layout)
    entry = copier.gather(block_ids)
    for i, name in enumerate(layout.layer_names):
        for j, b in enumerate(block_ids):
            assert torch.equal(entry[i].select(bd, j), caches[name].select(bd, b))
    fresh = torch.randn(entry.shape)
    copier.scatter(block_ids[1:], fresh, skip_blocks=1)
    for i, name in enumerate(layout.layer_names):
        assert torch.equal(caches[name].select(bd, block_ids[0]), entry[i].select(bd, 0))  # untouched
        for j, b in enumerate(block_ids[1:], start=1):
            assert torch.equal(caches[name].select(bd, b), fresh[i].select(bd, j))
