"""Load or recompute on a GPU, with CUDA faked at its boundary: the timing events.

On CUDA the connector sees a step end while its kernels are still queued, so forward
passes are timed by CUDA events on the compute stream, read back later without waiting
(``cache.vllm.step_clock``). Here ``FakeGpu`` stands in for the device: events complete
in the order they were recorded, when the test runs the GPU, at the times it says; an
event is never waited for (``synchronize`` fails the test). The worker side is real (CPU
blocks; only its step clock is the fake GPU's), and so is the scheduler side that turns
the timings into a prefill rate and the choice to load or recompute.
"""

from __future__ import annotations

import pytest
import torch

from cache.cost import attention_pairs
from cache.keys import Namespace
from cache.vllm import worker as worker_module
from cache.vllm.metadata import ChunkIO, LoadRequest, TieredKVMetadata
from cache.vllm.step_clock import MAX_PENDING, EventClock
from cache.vllm.worker import WorkerSide
from tests.test_load_costs import BYTES_PER_BLOCK, KEY, ask, config, scheduler_and_writer, stored
from tests.test_scheduler_side import BLOCK, CHUNK, output


class FakeGpu:
    """One CUDA stream as its timing events see it."""

    def __init__(self) -> None:
        self.queue: list[FakeEvent] = []  # recorded, not yet reached by the GPU
        self.recorded: list[FakeEvent] = []
        self.now_ms = 0.0

    def event(self) -> "FakeEvent":
        return FakeEvent(self)

    def run(self, *gaps_ms: float) -> None:
        """The GPU reaches the next queued events, each ``gap`` ms after the one before."""
        for gap in gaps_ms:
            self.now_ms += gap
            self.queue.pop(0).at_ms = self.now_ms

    def clock(self) -> EventClock:
        return EventClock(self.event, lambda: "compute stream")


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu, self.at_ms, self.stream = gpu, None, None

    def record(self, stream=None) -> None:
        self.stream = stream
        self.gpu.queue.append(self)
        self.gpu.recorded.append(self)

    def query(self) -> bool:
        return self.at_ms is not None

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "cudaEventElapsedTime on an event not yet reached"
        return end.at_ms - self.at_ms

    def synchronize(self) -> None:
        raise AssertionError("the forward thread waited for the GPU")


@pytest.fixture
def gpu(monkeypatch):
    """The worker's step clock is the fake GPU's (what ``step_clock`` gives a CUDA device)."""
    fake = FakeGpu()
    monkeypatch.setattr(worker_module, "step_clock", lambda device: fake.clock())
    return fake


def worker(tmp_path, **extra):
    side = WorkerSide(
        config(tmp_path, **extra),
        Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK),
        num_blocks=8,
        block_size=BLOCK,
    )
    side.register_kv_caches({f"layer.{i}": torch.randn(8, 2, BLOCK, 2, 8).to(torch.bfloat16) for i in range(2)})
    return side


def step(side, compute, loads=()):
    """One engine step as the connector drives the worker: bind, loads, forward, save."""
    meta = TieredKVMetadata(loads=list(loads), compute=compute)
    side.step_begins(meta)
    side.start_load_kv(meta)
    side.wait_for_save(meta)


def samples(side):
    meta = side.take_settled()
    return [s for s in meta.samples if s[0] == "step"] if meta else []


def test_a_step_is_timed_by_its_events_once_the_gpu_has_passed_them(tmp_path, gpu):
    side = worker(tmp_path)
    step(side, (64, 2048.0))
    assert samples(side) == []  # kernels still queued: nothing yet, and nothing waited
    gpu.run(3.0, 150.0)  # begin reached 3 ms in, end 150 ms later
    assert samples(side) == [("step", 64, 2048.0, pytest.approx(0.150))]
    assert {e.stream for e in gpu.recorded} == {"compute stream"}
    step(side, None)  # a step without prefill records nothing
    assert gpu.queue == [] and samples(side) == []
    side.shutdown()


def test_steps_scheduled_ahead_of_the_gpu_keep_their_own_times(tmp_path, gpu):
    """vLLM's asynchronous scheduling: the host binds and ends step 2 before the GPU has
    begun step 1; each step's pair of events brackets its own kernels."""
    side = worker(tmp_path)
    step(side, (512, attention_pairs(512, 0)))
    step(side, (1024, attention_pairs(1024, 512)))
    gpu.run(0.0, 40.0)  # step 1's begin, end
    assert samples(side) == [("step", 512, attention_pairs(512, 0), pytest.approx(0.040))]
    gpu.run(0.5)  # step 2's begin only
    assert samples(side) == []
    gpu.run(90.0)
    assert samples(side) == [("step", 1024, attention_pairs(1024, 512), pytest.approx(0.090))]
    side.shutdown()


def test_a_synchronous_load_is_not_counted_in_the_forward_pass(tmp_path, gpu):
    """The step's time starts once its synchronous load is in place (the host clock
    subtracts the load instead)."""
    side = worker(tmp_path)
    side.wait_for_save(TieredKVMetadata(saves=[ChunkIO(KEY, None, [0, 1])]))
    side.store.flush(10)
    step(side, (100, 5000.0), [LoadRequest("r", [ChunkIO(KEY, None, [4, 5])], False)])
    assert side.get_block_ids_with_load_errors() == set()
    gpu.run(1.0, 30.0, 20.0)  # bind, after the load (30 ms later), end of the forward pass
    assert samples(side) == [("step", 100, 5000.0, pytest.approx(0.020))]
    side.shutdown()


def test_a_gpu_far_behind_keeps_a_bounded_queue(tmp_path, gpu):
    side = worker(tmp_path)
    for i in range(MAX_PENDING + 5):
        step(side, (i + 1, 1.0))
        assert samples(side) == []
    gpu.run(*[1.0] * len(gpu.queue))  # the GPU catches up: the oldest 5 steps were forgotten
    assert [s[1] for s in samples(side)] == list(range(6, MAX_PENDING + 6))
    side.shutdown()


# Forward passes as the engine would run them: 2 ms a step plus 0.1 ms per token (the
# law tests/test_load_costs.py feeds the planner directly).
STEPS = [(16, 2000), (64, 0), (512, 512), (2048, 0), (1024, 1024)]


@pytest.mark.parametrize("gpu_ran", [True, False])
def test_the_cost_model_recomputes_a_slow_tier_on_the_cuda_timed_path(tmp_path, gpu, gpu_ran):
    """The scheduler sends each step's compute, the worker times its forward pass with
    CUDA events, the samples go back with a later step's output, and the scheduler's
    prefill rate, next to a slow disk's measured rate, makes it recompute a disk hit.
    Without the GPU's timings (its events never reached: no prefill rate) every hit loads."""
    side, writer = scheduler_and_writer(config(tmp_path))
    gpu_worker = worker(tmp_path / "worker")
    stored(side, writer, 1500, lambda i: 1)  # every chunk on disk
    side.planner.observe([("load", "disk", int(n), 0.001 + n / 50e6) for n in (1e6, 1e7, 1e8)])
    for i, (n, cached) in enumerate(STEPS):
        meta = side.build_connector_meta(output(new=[(f"p{i}", cached)], scheduled={f"p{i}": n}))
        assert meta.compute == (n, attention_pairs(n, cached))
        gpu_worker.step_begins(meta)
        gpu_worker.start_load_kv(meta)
        gpu_worker.wait_for_save(meta)
        if gpu_ran:
            gpu.run(0.3, 2.0 + 0.1 * n)
        reported = gpu_worker.take_settled()  # with this step's output (connector.update_connector_output)
        if reported is not None:
            side.planner.observe(reported.samples)
    side.build_connector_meta(output())  # those requests are done: nothing else runs
    assert (side.planner.prefill.fit.samples == len(STEPS)) is gpu_ran
    assert 1500 * BYTES_PER_BLOCK // BLOCK / 50e6 > 0.002 + 1e-4 * 1500  # the disk is the slower way
    _, got = ask(side, "slow", 1500)
    assert got == ((0, False) if gpu_ran else (1499, False))
    gpu_worker.shutdown()
