"""The store's background writes wait for a quiet engine, briefly (cache.store.idle_gate):
real threads, a real Background and its writer thread."""

from __future__ import annotations

import contextlib
import threading
import time

from cache.store.background import Background
from cache.store.idle_gate import IdleGate


def _write_after(bg: Background) -> tuple[threading.Event, list[float]]:
    """Queue a write on ``bg``'s writer thread; the event is set when it ran."""
    ran, at = threading.Event(), []
    bg.write(lambda: (at.append(time.monotonic()), ran.set()))
    return ran, at


@contextlib.contextmanager
def _busy(gate: IdleGate):
    """A Background behind ``gate`` while a step runs (begun, not ended); shut down after."""
    bg = Background(1, False, gate=gate)
    try:
        gate.step_began()
        yield bg
    finally:
        bg.shutdown()


def test_a_write_waits_while_a_step_runs_and_goes_once_quiet():
    gate = IdleGate(max_wait_s=5.0, quiet_s=0.02)
    with _busy(gate) as bg:
        ran, _ = _write_after(bg)
        assert not ran.wait(0.2)  # held: a step is running
        gate.step_ended()
        ended = time.monotonic()
        assert ran.wait(2.0)
        assert time.monotonic() - ended >= 0.015  # (after the quiet time, not at once)


def test_a_write_never_waits_longer_than_max_wait():
    with _busy(IdleGate(max_wait_s=0.15, quiet_s=0.02)) as bg:  # a step that never ends: sustained load
        queued = time.monotonic()
        ran, at = _write_after(bg)
        assert ran.wait(2.0)
        assert 0.14 <= at[0] - queued < 1.0


def test_hurry_and_flush_let_the_queued_writes_go_at_once():
    gate = IdleGate(max_wait_s=30.0, quiet_s=0.02)
    with _busy(gate) as bg:
        ran, _ = _write_after(bg)
        assert not ran.wait(0.1)
        gate.hurry()  # a request waits for this save
        assert ran.wait(1.0)
        later, _ = _write_after(bg)  # queued after the hurry: held again
        assert not later.wait(0.1)
        t = time.monotonic()
        assert bg.flush(timeout=2.0)
        assert later.is_set() and time.monotonic() - t < 1.0


def test_pressure_lets_writes_go():
    pressed = threading.Event()
    with _busy(IdleGate(max_wait_s=30.0, quiet_s=0.02, pressed=pressed.is_set)) as bg:
        ran, _ = _write_after(bg)
        assert not ran.wait(0.1)
        pressed.set()  # staging filling up: holding writes would drop saves
        assert ran.wait(1.0)


def test_without_a_gate_writes_run_at_once():
    bg = Background(1, False)
    try:
        ran, _ = _write_after(bg)
        assert ran.wait(1.0)
    finally:
        bg.shutdown()
