"""Block copies between a paged KV cache and entries (the CPU path), and the views
``KVLayout`` accepts or refuses. vLLM 0.32's own views, every layout: test_kv_layout.py."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cache.vllm.kv_copy import BlockCopier, KVLayout
from cache.vllm.staging import StagingPool


@pytest.mark.parametrize("shape", [(10, 2, 4, 8), (10, 4, 16), (10, 2, 3, 4, 8)])
def test_gather_scatter_roundtrip(shape):
    num_blocks = 10
    caches = {f"l{i}": torch.randn(shape).to(torch.bfloat16) for i in range(3)}
    layout = KVLayout.of(caches, num_blocks)
    copier = BlockCopier(caches, layout)
    entry = copier.gather([7, 2, 5])
    assert tuple(entry.shape) == layout.entry_shape(3) == (3, 3, *shape[1:])
    for i, name in enumerate(layout.layer_names):
        assert torch.equal(entry[i, 1], caches[name][2])

    # scatter into other blocks, skipping the entry's first block
    copier.scatter([0, 9], entry, skip_blocks=1)
    for name in layout.layer_names:
        assert torch.equal(caches[name][0], caches[name][2])
        assert torch.equal(caches[name][9], caches[name][5])
    assert layout.bytes_per_block() * 3 == entry.numel() * entry.element_size()

    # load only the entry's leading blocks (a tail whose last block holds only the
    # prompt's last token, which vLLM computes)
    copier.scatter([4], entry, skip_blocks=1)
    for name in layout.layer_names:
        assert torch.equal(caches[name][4], caches[name][2])


def test_wrong_entry_shape_is_refused():
    caches = {"l0": torch.zeros(4, 2, 3)}
    copier = BlockCopier(caches, KVLayout.of(caches, 4))
    with pytest.raises(ValueError):
        copier.scatter([0, 1], torch.zeros(1, 1, 2, 3))  # one block held, two asked for
    with pytest.raises(ValueError):
        copier.scatter([0], torch.zeros(1, 2, 2, 4))  # foreign block shape


@pytest.mark.parametrize(
    "caches,num_blocks,why",
    [
        ({"l0": torch.zeros(3, 3, 3)}, 7, "whole number of kernel blocks"),
        ({"l0": torch.zeros(2, 6, 4)}, 6, "whole number of kernel blocks"),  # an older vLLM's [2, blocks, ...]
        ({"l0": torch.zeros(4096, dtype=torch.int8)}, 8, "flat"),  # a spec without per-layer views
        ({"l0": torch.zeros(12, 5, 8)}, 4, r"only \[blocks, heads, tokens, content\] views"),  # split, 3-D
        ({"l0": torch.zeros(8, 4, 6).transpose(1, 2)}, 8, "innermost dimension is not contiguous"),
        ({"l0": torch.zeros(8, 2, 4, 8), "l1": torch.zeros(8, 2, 4, 4)}, 8, "differs in shape or dtype"),
    ],
)
def test_views_the_cache_cannot_read_are_refused_with_the_reason(caches, num_blocks, why):
    with pytest.raises(ValueError, match=why):
        KVLayout.of(caches, num_blocks)


def test_kernel_blocks_are_regrouped_into_the_manager_blocks_entries_hold():
    """A manager block of 8 tokens split into 4 kernel blocks of 2 (the view has 4 rows per
    block): the entry is the same as from the unsplit view of the same tokens."""
    blocks, heads, tokens, content, split = 5, 3, 8, 4, 4
    whole = torch.randn(blocks, heads, tokens, content)
    # the same KV in kernel blocks: row b*4+k holds tokens 2k, 2k+1 of manager block b
    kernel = (
        whole.unflatten(2, (split, tokens // split))
        .permute(0, 2, 1, 3, 4)
        .reshape(blocks * split, heads, tokens // split, content)
        .contiguous()
    )
    a, b = KVLayout.of({"l": whole}, blocks), KVLayout.of({"l": kernel}, blocks)
    assert (a.split, b.split) == (1, 4) and a.entry_shape(2) == b.entry_shape(2)
    assert torch.equal(BlockCopier({"l": kernel}, b).gather([3, 1]), BlockCopier({"l": whole}, a).gather([3, 1]))
    fresh = torch.randn(a.entry_shape(1))
    BlockCopier({"l": kernel}, b).scatter([4], fresh)
    assert torch.equal(kernel[16:20], fresh[0, 0].unflatten(1, (split, 2)).permute(1, 0, 2, 3))
    assert not BlockCopier({"l": kernel}, b).placeable and BlockCopier({"l": whole}, a).placeable


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32])
def test_any_dtype_is_copied_as_bytes_bit_for_bit(dtype):
    raw = torch.randint(0, 256, (6, 2, 4, 16), dtype=torch.uint8)
    caches = {"l0": raw.view(dtype)}
    layout = KVLayout.of(caches, 6)
    assert layout.word == torch.int64 and layout.dtype == dtype
    copier = BlockCopier(caches, layout)
    entry = copier.gather([5, 0])
    assert torch.equal(entry.view(torch.uint8)[0, 0], raw[5])  # NaN bit patterns too
    copier.scatter([2], entry)
    assert torch.equal(raw[2], raw[5])


@pytest.mark.parametrize("block_ids", [[3, 4, 5, 6, 7, 8], [8, 1, 6, 3, 10, 5], [2, 3, 9, 10, 11, 0]])
@pytest.mark.parametrize("shape", [(12, 2, 4, 8), (12, 4, 8)])
def test_cpu_copies_of_runs_and_scattered_blocks_agree_with_indexing(block_ids, shape):
    """Consecutive blocks are copied as slices, scattered ones (more runs than
    MAX_SLICE_RUNS) by index: both give what indexing the blocks one by one gives."""
    caches = {f"l{i}": torch.randn(shape) for i in range(2)}
    layout = KVLayout.of(caches, 12)
    copier = BlockCopier(caches, layout)
    entry = copier.gather(block_ids)
    for i, name in enumerate(layout.layer_names):
        for j, b in enumerate(block_ids):
            assert torch.equal(entry[i, j], caches[name][b])
    fresh = torch.randn(entry.shape)
    copier.scatter(block_ids[1:], fresh, skip_blocks=1)
    for i, name in enumerate(layout.layer_names):
        assert torch.equal(caches[name][block_ids[0]], entry[i, 0])  # untouched
        for j, b in enumerate(block_ids[1:], start=1):
            assert torch.equal(caches[name][b], fresh[i, j])


@pytest.mark.parametrize("block_ids", [[3, 4, 5, 6], [8, 1, 6, 3, 10, 5]])
@pytest.mark.parametrize("shape", [(12, 2, 4, 8), (12, 2, 3, 4, 8)])
def test_a_save_copied_on_the_copy_thread_is_the_entry_a_copy_here_makes(block_ids, shape):
    """A CPU save's copy on the worker's copy thread (numpy, run by run) gives the same
    entry, bit for bit, as the copy on the calling thread (torch)."""
    caches = {f"l{i}": torch.randn(shape).to(torch.bfloat16) for i in range(3)}
    layout = KVLayout.of(caches, 12)
    with ThreadPoolExecutor(1) as copies:
        got = BlockCopier(caches, layout, copies=copies).gather_async(block_ids)
        got.wait()
    assert torch.equal(got.host, BlockCopier(caches, layout).gather(block_ids))


def test_the_fence_holds_vllms_next_writes_until_the_copy_thread_has_read_the_blocks():
    """The copy thread may still read a save's blocks when the step ends; the blocks can be
    freed and written by the next step (zeroed, filled by another request). ``fence``,
    called before those writes, waits for the copy: the entry holds what the forward pass
    wrote. (With the fence a no-op the next step's zeros reach the entry: seen failing.)"""
    caches = {"l0": torch.full((6, 2, 4, 8), 7.0)}
    copier = BlockCopier(caches, KVLayout.of(caches, 6), copies=(copies := ThreadPoolExecutor(1)))
    busy = threading.Event()
    copies.submit(busy.wait, 10)  # the copy thread is busy: the save's copy waits in line
    got = copier.gather_async([1, 2])

    def next_step():
        copier.fence()
        caches["l0"][1:3] = 0.0  # vLLM zeroes the blocks it gave a new request

    step = threading.Thread(target=next_step)
    step.start()
    step.join(0.3)
    assert step.is_alive()  # held by the fence
    busy.set()
    step.join(10)
    got.wait()
    copies.shutdown()
    assert torch.equal(got.host, torch.full((1, 2, 2, 4, 8), 7.0)) and torch.equal(
        caches["l0"][1:3], torch.zeros(2, 2, 4, 8)
    )


def test_a_slot_given_back_before_its_copy_ended_is_free_only_after_it():
    """A save dropped before the writer took it (its queue full) gives its staging slot back
    at once; the copy into that slot may still be waiting for the copy thread. The slot is
    free only once the copy has ended, never to a new save while it is still written."""
    caches = {"l0": torch.full((6, 2, 4, 8), 7.0)}
    layout = KVLayout.of(caches, 6)
    pool = StagingPool(layout.bytes_per_block() * 2, 1)
    copier = BlockCopier(caches, layout, staging=pool, copies=(copies := ThreadPoolExecutor(1)))
    busy = threading.Event()
    copies.submit(busy.wait, 10)
    got = copier.gather_async([1, 2])
    got.release()  # dropped
    assert copier.gather_async([3, 4]) is None  # the one slot: still being copied into
    busy.set()
    copies.submit(lambda: None).result()  # the copy, and what ran once it ended, are done
    assert copier.gather_async([3, 4]) is not None
    copies.shutdown()
