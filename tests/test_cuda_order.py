"""The copier's CUDA ordering, by construction: its stream path run on CPU tensors with a
stand-in for ``cache.vllm.streams.CudaStreams`` that models torch's semantics (the
current stream is per thread; ``using(s)`` makes ``s`` current) and records every
wait, record and host synchronisation. The ordering itself, on a device, with teeth:
``bench.gpu_conformance``."""

import threading

import torch

from cache.threads import thread_setup
from cache.vllm.kv_copy import BlockCopier, KVLayout
from cache.vllm.staging import StagingPool


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name


class Event:
    def __init__(self, n: int, stream: Stream) -> None:
        self.n, self.stream, self.happened = n, stream, False


class Recorder:
    """``CudaStreams``' methods; ``log`` holds (thread, call, details) in call order."""

    def __init__(self) -> None:
        self.compute = Stream("compute")  # every thread's default stream, as in torch
        self.log: list[tuple] = []
        self.events: list[Event] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    def _note(self, *what) -> None:
        with self._lock:
            self.log.append((threading.current_thread().name, *what))

    def select(self) -> None:
        self._local.selected = True
        self._note("select")

    def current(self) -> Stream:
        stack = getattr(self._local, "stack", [])
        return stack[-1] if stack else self.compute

    def new_stream(self) -> Stream:
        return Stream("copy")

    def using(self, stream):
        recorder = self

        class Using:
            def __enter__(self):
                recorder._local.stack = [*getattr(recorder._local, "stack", []), stream]

            def __exit__(self, *exc):
                recorder._local.stack.pop()

        return Using()

    def mark(self, stream: Stream) -> Event:
        assert getattr(self._local, "selected", False), "CUDA work on a thread that selected no device"
        with self._lock:
            event = Event(len(self.events), stream)
            self.events.append(event)
        self._note("record", stream.name, event.n)
        return event

    def wait(self, stream: Stream, event: Event) -> None:
        self._note("wait", stream.name, event.stream.name, event.n)

    def synchronize(self, event: Event) -> None:
        assert getattr(self._local, "selected", False), "a wait on a thread that selected no device"
        event.happened = True
        self._note("sync", event.n)

    def happened(self, event: Event) -> bool:
        return event.happened

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.clone()

    def calls(self, thread: str = None) -> list[tuple]:
        return [entry[1:] for entry in self.log if thread is None or entry[0] == thread]


def copier(slots: int = 4, recorder=None):
    caches = {f"l{i}": torch.randn(12, 2, 4, 8).to(torch.bfloat16) for i in range(3)}
    layout = KVLayout.of(caches, 12)
    recorder = recorder or Recorder()
    pool = StagingPool(layout.bytes_per_block() * 4, slots, happened=recorder.happened)
    return BlockCopier(caches, layout, staging=pool, streams=recorder), caches, recorder, pool


def test_a_gather_waits_for_the_compute_stream_taken_before_entering_its_own():
    c, caches, rec, _ = copier()
    me = threading.current_thread().name
    got = c.gather_async([7, 2, 5])
    calls = rec.calls(me)
    # the compute stream's point, recorded before the copier's stream became current ...
    assert calls[:2] == [("select",), ("record", "compute", 0)]
    # ... is what the copier's stream waits on (the bug: a wait on the copier's own stream)
    assert calls[2] == ("wait", "copy", "compute", 0)
    assert calls[3] == ("record", "copy", 1)
    # the writer thread selects the device, then waits for the copy; the data is exact
    t = threading.Thread(target=got.wait, name="kvcache-write_0")
    t.start()
    t.join()
    assert rec.calls("kvcache-write_0") == [("select",), ("sync", 1)]
    for i, name in enumerate(c.layout.layer_names):
        assert torch.equal(got.host[i, 1], caches[name][2])
    # the next forward pass is fenced after the copy, on the GPU (no host sync)
    c.fence()
    assert rec.calls(me)[-2:] == [("select",), ("wait", "compute", "copy", 1)]
    c.fence()  # nothing new to fence
    assert rec.calls(me)[-1] == ("wait", "compute", "copy", 1)


def test_a_synchronous_load_orders_both_ways_without_blocking_the_host():
    c, caches, rec, pool = copier()
    entry = torch.randn(c.layout.entry_shape(3)).to(torch.bfloat16)
    me = threading.current_thread().name
    c.scatter([4, 9], entry, skip_blocks=1)
    assert rec.calls(me) == [
        ("select",),
        ("record", "compute", 0),
        ("wait", "copy", "compute", 0),
        ("record", "copy", 1),
        ("wait", "compute", "copy", 1),
    ]  # no ("sync", ...)
    for i, name in enumerate(c.layout.layer_names):
        assert torch.equal(caches[name][4], entry[i, 1]) and torch.equal(caches[name][9], entry[i, 2])
    # its staging slot comes back only once the copy's event has happened
    assert pool.taken == 1 and pool.in_use() == 1
    rec.events[1].happened = True
    assert [pool.take(1) is not None for _ in range(4)] == [True] * 4


def test_a_load_from_another_thread_follows_the_forward_threads_mark_and_ends_before_it_returns():
    c, caches, rec, _ = copier()
    mark = c.compute_mark()  # on the forward thread, before the forward pass is launched
    entry = torch.randn(c.layout.entry_shape(2)).to(torch.bfloat16)
    t = threading.Thread(target=c.scatter, args=([1, 3], entry), kwargs={"after": mark}, name="kvcache-load-r1")
    t.start()
    t.join()
    assert rec.calls("kvcache-load-r1") == [
        ("select",),
        ("wait", "copy", "compute", 0),
        ("record", "copy", 1),
        ("sync", 1),
    ]
    assert torch.equal(caches["l1"][3], entry[1, 1])


def test_saves_skip_rather_than_wait_when_the_staging_pool_is_full():
    c, caches, rec, pool = copier(slots=2)
    first, second = c.gather_async([1, 2]), c.gather_async([3])
    assert c.gather_async([4]) is None and pool.dropped_saves == 1  # the forward thread never waits
    first.release()  # the writer wrote it, but the copy into it has not ended: not yet reusable
    assert c.gather_async([4]) is None and pool.dropped_saves == 2
    first.wait()  # (the writer waits before it writes: the copy ended)
    third = c.gather_async([5])
    assert third is not None and third.host.data_ptr() == first.host.data_ptr()
    assert pool.high_water == 2 and pool.taken == 3 and second.host.data_ptr() != third.host.data_ptr()


def test_every_cache_thread_selects_the_workers_device_once_it_is_known():
    setup = thread_setup(frozenset())
    seen = []
    setup("read")  # before the device is known: nothing to select
    setup.select_device = lambda: seen.append(threading.current_thread().name)
    for role in ("read", "write", "load"):
        t = threading.Thread(target=setup, args=(role,), name=f"kvcache-{role}")
        t.start()
        t.join()
    assert seen == ["kvcache-read", "kvcache-write", "kvcache-load"]

    def broken():
        raise RuntimeError("no such device")

    setup.select_device = broken
    # logged: a thread pool whose initializer raises would stop working. On a thread of its
    # own: a writer's setup lowers its thread's priority, for good (pytest's main thread
    # once took it and every later test ran niced: test_threads then failed)
    t = threading.Thread(target=setup, args=("write",), name="kvcache-write")
    t.start()
    t.join()
