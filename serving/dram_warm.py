"""Warm scale-out, the server's side (``KVCACHE_WARM_DRAM``): ``/ping`` reports healthy only
once the DRAM tier holds the warm-prompt set and the fleet's hottest shared entries, or
at the start-up deadline.

Runs in the server process, on the event loop, in ``Engine.start`` right after the engine
is ready. It tokenizes the warm prompts (``KVCACHE_WARM_PROMPTS``, as ``cache.tools.warm``
does, in a thread), starts every worker's warm-up (``collective_rpc``:
``cache.vllm.warm_rpc``; the copying is ``cache.dram_warm``, on a thread of each worker),
then asks them every ``POLL_S`` how far they are, logging progress every ``LOG_S``.
Meanwhile ``/ping`` answers 503 ``warming dram`` (``finished`` is False). It ends when
every rank has finished (done, failed, or no cache to warm), or at ``deadline``: the
start-up timeout (``SAGEMAKER_STARTUP_TIMEOUT``) counted from the start of the engine's
start-up. Then the workers are told to stop and the log says what was not warmed. Either
way ``/ping`` then reports healthy: a warm-up never keeps an instance out of service.

``progress`` and ``state`` are plain fields, read by ``/ping`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from cache.sizes import human_bytes
from serving.config import EngineSettings

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the workers are asked
LOG_S = 10.0  # how often progress is logged
STOP_TIMEOUT_S = 10.0
SETS = ("prompts", "hot")
FIELDS = ("planned", "warm", "copied", "bytes", "absent", "skipped")
ENDED = ("done", "stopped", "failed", "off")  # a worker's warm-up that ended
STATES = ("warming", "done", "deadline", "failed", "stopped")


class DramWarm:
    """One instance's DRAM warm-up, from the server: ``run`` once; ``cancel`` any time."""

    def __init__(self, settings: EngineSettings, deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``deadline``: ``clock()`` time at which ``/ping`` turns healthy whatever is warm."""
        self.settings, self.deadline, self.clock = settings, deadline, clock
        self.state = "warming"
        self.ranks: list[dict] = []  # each worker's last status (cache.dram_warm.DramWarm.status)
        self._cancelled = False

    @property
    def finished(self) -> bool:
        return self.state != "warming"

    def cancel(self) -> None:
        """The server is stopping: end ``run`` at its next poll."""
        self._cancelled = True

    def progress(self) -> dict[str, dict[str, int]]:
        """Per set (``prompts``, ``hot``), every rank together: ``planned``, ``warm``,
        ``copied``, ``bytes``, ``absent``, ``skipped``."""
        out = {s: dict.fromkeys(FIELDS, 0) for s in SETS}
        for rank in self.ranks:
            for s in SETS:
                for f in FIELDS:
                    out[s][f] += int((rank.get(s) or {}).get(f, 0))
        return out

    async def run(self, client: Any) -> None:
        """The warm-up, to its end or the deadline; never raises (a failure is logged, and
        ``/ping`` turns healthy)."""
        try:
            await self._run(client)
        except Exception as e:
            log.error(
                "DRAM warm-up failed (%s: %s); /ping reports healthy without it", type(e).__name__, e, exc_info=True
            )
            self.state = "failed"

    async def _run(self, client: Any) -> None:
        path, budget = self.settings.warm_prompts, self.settings.warm_dram_bytes
        prompts = await asyncio.to_thread(_tokens, path, client.get_tokenizer()) if path else []
        log.info(
            "DRAM warm-up (KVCACHE_WARM_DRAM): copying the chunks of %d warm prompts and up to %s of "
            "the hottest shared entries into the DRAM tier; /ping answers 503 until it is done, at most "
            "%.0f s more (SAGEMAKER_STARTUP_TIMEOUT)",
            len(prompts),
            human_bytes(budget),
            max(0.0, self.deadline - self.clock()),
        )
        answer = await self._ask(client, "kvcache_warm_dram", {"prompts": prompts, "budget": budget})
        next_log = self.clock() + LOG_S
        while answer is not None:
            self.ranks = answer
            if all(r.get("state") in ENDED for r in self.ranks):
                self._ended()
                return
            if self._cancelled:
                self.state = "stopped"
                return
            if self.clock() >= next_log:
                log.info("DRAM warm-up: %s", _describe(self.progress()))
                next_log = self.clock() + LOG_S
            await asyncio.sleep(max(0.0, min(POLL_S, self.deadline - self.clock())))
            answer = await self._ask(client, "kvcache_warm_status")
        await self._cut(client)

    async def _ask(self, client: Any, method: str, *args) -> Optional[list[dict]]:
        """Every rank's answer; None once the deadline has passed (or passes meanwhile)."""
        left = self.deadline - self.clock()
        if left <= 0:
            return None
        try:
            return [dict(r) for r in await asyncio.wait_for(client.collective_rpc(method, args=args), left)]
        except asyncio.TimeoutError:
            return None

    def _ended(self) -> None:
        """Every rank finished: logged first, then ``/ping`` turns healthy."""
        failed = [r for r in self.ranks if r.get("state") == "failed"]
        off = [r for r in self.ranks if r.get("state") == "off"]
        seconds = max((float(r.get("seconds") or 0) for r in self.ranks), default=0.0)
        notes = max((int(r.get("notes") or 0) for r in self.ranks), default=0)
        if failed or off:
            log.warning(
                "DRAM warm-up ended: %s; /ping reports healthy",
                "; ".join(sorted({str(r.get("error") or r.get("state")) for r in failed + off})),
            )
        log.info(
            "DRAM warm-up done in %.1f s (%d popularity notes read): %s; /ping reports healthy",
            seconds,
            notes,
            _describe(self.progress()),
        )
        self.state = "failed" if failed else "done"

    async def _cut(self, client: Any) -> None:
        """The deadline passed: healthy now, the workers told to stop, the rest logged."""
        self.state = "deadline"
        try:
            answer = await asyncio.wait_for(client.collective_rpc("kvcache_warm_stop"), STOP_TIMEOUT_S)
            self.ranks = [dict(r) for r in answer]
        except Exception as e:  # the log below says what was known before
            log.warning("DRAM warm-up: stopping the workers' copies failed: %s", e)
        p = self.progress()
        log.warning(
            "DRAM warm-up cut at the start-up deadline (SAGEMAKER_STARTUP_TIMEOUT); /ping reports "
            "healthy. Not warmed: %s. Warm: %s",
            _missing(p),
            _describe(p),
        )


def _tokens(path: str, tokenizer) -> list[list[int]]:
    from cache.tools.warm import read_prompts

    return read_prompts(path, tokenizer)


def _describe(p: dict[str, dict[str, int]]) -> str:
    out = []
    for name, s in (("warm prompts' chunks", p["prompts"]), ("hottest shared entries", p["hot"])):
        line = f"{name} {s['warm']} of {s['planned']} in DRAM ({human_bytes(s['bytes'])}, {s['copied']} copied"
        if s["absent"]:
            line += f", {s['absent']} in no tier"
        if s["skipped"]:
            line += f", {s['skipped']} passed over (no room in the budget or DRAM, or their prefix is not warm)"
        out.append(line + ")")
    return "; ".join(out)


def _missing(p: dict[str, dict[str, int]]) -> str:
    return (
        f"{p['prompts']['planned'] - p['prompts']['warm']} of {p['prompts']['planned']} warm prompts' chunks, "
        f"{p['hot']['planned'] - p['hot']['warm']} of {p['hot']['planned']} hottest shared entries"
    )
