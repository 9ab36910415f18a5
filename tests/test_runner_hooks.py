"""The connector under both of vLLM 0.32's model runners, driven by vLLM's own hook code.

V1 (``vllm/v1/worker/gpu_model_runner.py``; the CPU build always runs it): ``execute_model``
calls ``handle_preemptions`` first, then ``_update_states`` (vLLM's own writes to KV
blocks: zeroing new blocks, copy-on-write copies), then runs the forward pass inside
``KVConnectorModelRunnerMixin``'s context manager, which binds the metadata, starts the
loads (synchronous ones before the forward pass, others after it) and afterwards calls
``wait_for_save`` and collects the step's results. V2 (``vllm/v1/worker/gpu/``, the GPU
default; it needs Triton, so it cannot run here): ``update_requests`` writes blocks, then
``ActiveKVConnector.pre_forward`` (``handle_preemptions``, bind, synchronous loads) just
before the forward pass, ``finish_forward``, and ``post_forward`` (asynchronous loads,
``wait_for_save``, results) after sampling. ``no_forward`` steps run the same hooks.

Each step here runs vLLM's hook code itself (the mixin, ``ActiveKVConnector``) against the
real connector on CPU blocks; only the model runners' ``execute_model`` around it, which
cannot run without an engine, is replayed by hand, and the last test fails the day vLLM
moves the calls that replay depends on.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
import traceback
from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.v1.worker import kv_connector_model_runner_mixin as v1_hooks
from vllm.v1.worker.gpu import kv_connector as v2_hooks

from cache.vllm import worker as worker_module
from cache.vllm.kv_copy import BlockCopier
from cache.vllm.metadata import ChunkIO, LoadRequest, TieredKVMetadata
from tests.test_gpu_step_timing import FakeGpu
from tests.vllm_harness import connector, engine_config, full_attention, kv_caches

KEY = "cd" * 16


@pytest.fixture(scope="module")
def bare_config():
    return VllmConfig()  # what vLLM's forward context needs; the connector has its own


class V1:
    """One engine step as V1's ``GPUModelRunner.execute_model`` drives the connector."""

    def __init__(self, conn, caches, monkeypatch, config) -> None:
        monkeypatch.setattr(v1_hooks, "get_kv_transfer_group", lambda: conn)
        monkeypatch.setattr(v1_hooks, "has_kv_transfer_group", lambda: True)
        conn.register_kv_caches(caches)  # initialize_kv_cache
        self.conn, self.config = conn, config

    def step(self, so, forward=lambda: None, vllm_writes=lambda: None):
        self.conn.handle_preemptions(so.kv_connector_metadata)
        vllm_writes()  # _update_states
        with (
            set_forward_context(None, self.config),
            v1_hooks.KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as out,
        ):
            forward()
        return out

    def idle(self, so):
        self.conn.handle_preemptions(so.kv_connector_metadata)
        return v1_hooks.KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.config).kv_connector_output


class V2:
    """One engine step as V2's ``GPUModelRunner.execute_model`` and ``sample_tokens`` drive it."""

    def __init__(self, conn, caches, monkeypatch, config) -> None:
        monkeypatch.setattr(v2_hooks, "get_kv_transfer_group", lambda: conn)
        self.hooks = v2_hooks.ActiveKVConnector(config, caches)  # registers the caches

    def step(self, so, forward=lambda: None, vllm_writes=lambda: None):
        vllm_writes()  # update_requests
        self.hooks.pre_forward(so)
        forward()
        self.hooks.finish_forward()
        return self.hooks.post_forward(so.finished_req_ids)  # sample_tokens, after sampling

    def idle(self, so):
        return self.hooks.no_forward(so).kv_connector_output


@pytest.fixture(params=["v1", "v2"])
def engine(request, tmp_path, monkeypatch, bare_config):
    """The connector's worker side under one model runner, CPU blocks, a fake GPU clock."""
    gpu = FakeGpu()
    monkeypatch.setattr(worker_module, "step_clock", lambda device: gpu.clock())
    v2 = request.param == "v2"
    conn = connector(monkeypatch, engine_config(tmp_path, v2=v2), KVConnectorRole.WORKER, full_attention())
    caches = kv_caches(full_attention())
    runner = (V2 if v2 else V1)(conn, caches, monkeypatch, bare_config)
    yield SimpleNamespace(runner=runner, caches=caches, gpu=gpu, conn=conn)
    conn.shutdown()


def so(meta=None, sync=False):
    return SimpleNamespace(
        kv_connector_metadata=meta or TieredKVMetadata(), has_sync_kv_loads=sync, finished_req_ids=set()
    )


def until(engine, done, timeout=120.0):
    """Empty steps until ``done(output)``; the outputs seen. A generous bound: the
    machine may be shared with an engine. On timeout, every thread's stack (where a load
    is stuck, or that none is running)."""
    seen, end = [], time.monotonic() + timeout
    while not seen or not done(seen[-1]):
        if time.monotonic() > end:
            pytest.fail(f"not done after {timeout:.0f} s of empty steps; outputs {seen[-3:]}\n{thread_stacks()}")
        seen.append(engine.runner.idle(so()))
        time.sleep(0.01)
    return seen


def thread_stacks() -> str:
    """Every thread's stack, for a wait that timed out: where a load is stuck."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()  # noqa: SLF001
    )


def blocks(engine, ids):
    return [t[ids].clone() for t in engine.caches.values()]


def save_computed_chunk(engine):
    """A step whose forward pass writes blocks 0-1 and whose metadata saves them."""

    def forward():
        for t in engine.caches.values():
            t[0:2] = 7.0

    def settled(out):
        return out and out.kv_connector_worker_meta and KEY in out.kv_connector_worker_meta.settled

    if not settled(engine.runner.step(so(TieredKVMetadata(saves=[ChunkIO(KEY, None, [0, 1])])), forward)):
        until(engine, settled)


def test_a_save_takes_what_the_forward_pass_wrote(engine):
    save_computed_chunk(engine)  # settled: stored, not refused

    def forward():  # a DRAM hit: in its blocks before the forward pass reads them
        assert all(torch.equal(t[4:6], torch.full_like(t[4:6], 7.0)) for t in engine.caches.values())

    out = engine.runner.step(
        so(TieredKVMetadata(loads=[LoadRequest("r", [ChunkIO(KEY, None, [4, 5])], False)]), sync=True), forward
    )
    assert not out.invalid_block_ids


@pytest.mark.parametrize("load_ends_first", [False, True], ids=["as-it-comes", "load-ends-within-its-step"])
def test_an_asynchronous_load_is_reported_once_when_done(engine, monkeypatch, load_ends_first):
    """Both runners start an asynchronous load after the forward pass and ask for finished
    loads right after (``wait_for_save``, then ``get_transfer_results``): a load done by
    then (a short one, or a main thread the OS set aside) is reported by the step that
    started it, else by a later one; exactly once either way. (Until 2026-12-03 this test
    waited for a later step only, and hung whenever the load won that race: under CPU
    load about 1 run in 35; the quarantine it was under is lifted.)"""
    save_computed_chunk(engine)
    before = blocks(engine, slice(8, 10))
    if load_ends_first:  # the race made certain: vLLM asks once the load's thread is gone
        ask = engine.conn.get_transfer_results

        def after_the_load(finished):
            end = time.monotonic() + 120
            while any(t.name == "kvcache-load-a" for t in threading.enumerate()) and time.monotonic() < end:
                time.sleep(0.001)
            return ask(finished)

        monkeypatch.setattr(engine.conn, "get_transfer_results", after_the_load)
    load = LoadRequest("a", [ChunkIO(KEY, None, [8, 9])], True)
    first = engine.runner.step(so(TieredKVMetadata(loads=[load])))  # started after the forward pass
    reported = lambda out: bool(out and out.finished_recving)  # noqa: E731
    assert reported(first) or not load_ends_first
    seen = [first] if reported(first) else [first] + until(engine, reported)
    seen += [engine.runner.idle(so()) for _ in range(3)]  # and never again
    assert [out.finished_recving for out in seen if reported(out)] == [{"a"}]
    assert all(not out.failed_recving and not out.invalid_block_ids for out in seen if out)
    assert not any(torch.equal(a, b) for a, b in zip(before, blocks(engine, slice(8, 10))))
    assert all(torch.equal(t[8:10], t[0:2]) for t in engine.caches.values())


def test_earlier_saves_are_fenced_before_vllm_writes_blocks(engine, monkeypatch):
    """On CUDA a save's copy is still reading its blocks after ``wait_for_save``; the blocks
    may be freed and given to a new request at once, which vLLM zeroes or fills by
    copy-on-write before the next forward pass. The compute stream must wait for the copy
    before those writes: V1 fences in ``handle_preemptions``, V2 (which calls it after
    them) at the end of the step before."""
    log = []
    gather, fence = BlockCopier.gather_async, BlockCopier.fence
    monkeypatch.setattr(BlockCopier, "gather_async", lambda self, ids: (log.append("gather"), gather(self, ids))[1])
    monkeypatch.setattr(BlockCopier, "fence", lambda self: (log.append("fence"), fence(self))[1])
    writes = lambda: log.append("vLLM writes blocks")  # noqa: E731
    engine.runner.step(so(TieredKVMetadata(saves=[ChunkIO(KEY, None, [0, 1])])), vllm_writes=writes)
    engine.runner.step(so(), vllm_writes=writes)
    gathered = log.index("gather")
    next_writes = log.index("vLLM writes blocks", gathered)
    assert "fence" in log[gathered:next_writes], log


def test_each_forward_pass_is_timed_on_the_gpu_without_waiting(engine):
    """The step's events are recorded where each runner calls the hooks (bind .. its
    wait_for_save) and read back by a later step once the GPU has passed them."""
    out = engine.runner.step(so(TieredKVMetadata(compute=(64, 2048.0))))
    assert not (out and out.kv_connector_worker_meta)  # still queued on the GPU
    engine.gpu.run(0.2, 25.0)
    (out,) = until(engine, lambda out: out and out.kv_connector_worker_meta)
    assert out.kv_connector_worker_meta.samples == [("step", 64, 2048.0, pytest.approx(0.025))]


def test_the_runner_code_replayed_here_is_where_these_tests_put_it():
    """The calls the replay above makes by hand, read from vLLM's sources."""
    from vllm.v1.worker import gpu_model_runner as v1_runner
    from vllm.v1.worker.gpu import model_runner as v2_runner

    v1 = inspect.getsource(v1_runner.GPUModelRunner.execute_model)
    assert (
        v1.index("handle_preemptions(") < v1.index("self._update_states(") < v1.index("maybe_get_kv_connector_output(")
    )
    # vLLM's own runner code: where it writes KV blocks, which the fence must precede
    v1_writes = inspect.getsource(v1_runner.GPUModelRunner._update_states)  # noqa: SLF001
    assert "_zero_block_ids(" in v1_writes and "copy_kv_cache_blocks_inplace(" in v1_writes
    v2 = inspect.getsource(v2_runner.GPUModelRunner.execute_model)
    assert (
        v2.index("self.update_requests(")
        < v2.index("kv_connector.pre_forward(")
        < v2.index("kv_connector.finish_forward(")
    )
    v2_writes = inspect.getsource(v2_runner.GPUModelRunner.update_requests)
    assert "zero_block_ids(" in v2_writes and "copy_kv_cache_blocks_inplace(" in v2_writes
    sample = inspect.getsource(v2_runner.GPUModelRunner.sample_tokens)
    assert sample.index("self.sample(") < sample.rindex("kv_connector.post_forward(")
    assert "handle_preemptions(" in inspect.getsource(v2_hooks.ActiveKVConnector.pre_forward)
