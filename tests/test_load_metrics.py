"""Time to first token by the load a request arrived at (the dashboard's live capacity
curve), without an engine: the bands, the histogram ``ServingMetrics`` keeps, and the
count of requests in flight that ``ObservedEngine`` keeps around a stand-in of vLLM's
``AsyncLLM.generate`` (the check through a real server's ``/metrics`` is in
``tests/test_server.py``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from serving.engine import ObservedEngine
from serving.metrics import RequestOutcome, ServingMetrics, in_flight_band


def test_bands_are_powers_of_two():
    got = {n: in_flight_band(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 100, 128, 129, 256, 257, 10_000)}
    assert got == {
        1: "1",
        2: "2",
        3: "3-4",
        4: "3-4",
        5: "5-8",
        8: "5-8",
        9: "9-16",
        16: "9-16",
        17: "17-32",
        100: "65-128",
        128: "65-128",
        129: "129-256",
        256: "129-256",
        257: "257+",
        10_000: "257+",
    }
    with pytest.raises(ValueError, match="must be >= 1"):
        in_flight_band(0)


def test_ttft_is_recorded_by_the_band_of_requests_in_flight_at_arrival():
    m = ServingMetrics(2048, ("dram",))
    m.observe(RequestOutcome(100, 2, 0, ttft_s=0.3, in_flight=1))
    m.observe(RequestOutcome(100, 2, 0, ttft_s=1.5, in_flight=6))
    m.observe(RequestOutcome(100, 2, 0, ttft_s=3.0, in_flight=7))
    m.observe(RequestOutcome(100, 2, 0, ttft_s=None, in_flight=7))  # no token: no TTFT
    m.observe(RequestOutcome(100, 2, 0, ttft_s=0.2))  # load not known: not on the curve
    text = generate_latest(m.registry).decode()
    name = "kvcache_time_to_first_token_by_load_seconds"
    assert f'{name}_count{{in_flight="1"}} 1.0' in text
    assert f'{name}_count{{in_flight="5-8"}} 2.0' in text
    assert f'{name}_sum{{in_flight="5-8"}} 4.5' in text
    assert f'{name}_bucket{{in_flight="5-8",le="2.0"}} 1.0' in text  # the SLO is a bucket edge
    assert text.count(f"{name}_count") == 2


class _Client:
    """A stand-in of ``AsyncLLM.generate``: each stream yields one more token per ``step``
    event (cumulative outputs, vLLM's default), finished after two."""

    def __init__(self) -> None:
        self.step = asyncio.Event()

    async def generate(self, prompt, params, request_id):
        for i in range(2):
            await self.step.wait()
            self.step.clear()
            yield SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=list(range(i + 1)))],
                finished=i == 1,
                prompt_token_ids=[1, 2],
                num_cached_tokens=0,
                kv_transfer_params=None,
            )


def test_observed_engine_counts_the_requests_in_flight_each_arrived_at():
    async def main():
        outcomes: list[RequestOutcome] = []
        client = _Client()
        engine = ObservedEngine(client, outcomes.append)
        params = SimpleNamespace(output_kind=None)

        async def consume(rid):
            return [o async for o in engine.generate([1, 2], params, rid)]

        first = asyncio.create_task(consume("a"))
        await asyncio.sleep(0)  # a has arrived and waits for its first token
        second = asyncio.create_task(consume("b"))
        await asyncio.sleep(0)
        assert engine.in_flight == 2
        while not (first.done() and second.done()):
            client.step.set()
            await asyncio.sleep(0)
        assert engine.in_flight == 0  # both streams closed
        third = asyncio.create_task(consume("c"))
        while not third.done():
            client.step.set()
            await asyncio.sleep(0)
        return outcomes

    outcomes = asyncio.run(main())
    # in the order they finished (a, b, c): the load each arrived at, not the load at its end
    # (a finished while b was still in flight; b after a had closed)
    assert [o.in_flight for o in outcomes] == [1, 2, 1]
    assert all(o.ttft_s is not None and o.generated_tokens == 2 for o in outcomes)
