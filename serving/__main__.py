"""``python -m serving``: the SageMaker server (what ``entrypoint.sh serve`` runs).

Runs in the container's main process (PID 1 after ``exec``). Order of events:
1. build the configuration from the environment and the machine, log it and the tier
   plan as one block (a bad setting: message on stderr, exit 2);
2. remove the shared-memory and rendezvous files a killed predecessor's vLLM left
   (``serving.leftovers``: only files no live process holds; again once the engine is
   ready);
3. bind the port (``SAGEMAKER_BIND_TO_PORT``, default 8080) and start vLLM in the
   background; ``/ping`` answers 503 until the engine is ready;
4. on SIGTERM: ``/ping`` and new requests answer 503, requests in flight go on (up to
   ``SERVING_DRAIN_SECONDS``); those still running then answer 503 (a stream ends with
   an error event); vLLM shuts down, its workers flushing the cache's write-behind, and
   the process exits 0, inside SageMaker's 30 s.
If the engine cannot start, the process exits 1. If the engine dies while serving (its
engine-core process exits or fails), the server stops taking requests (503), answers
the requests in flight with the JSON 503 (a stream ends with a 503 error event), shuts
down and exits 1 within seconds, so that SageMaker or Kubernetes replaces it: a server
never stays up answering ``503 engine dead``.

    python -m serving                 # serve
    python -m serving --print-config  # show the configuration and tier plan, then exit
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import uvicorn

from cache.errors import ConfigError
from serving.app import create_app
from serving.config import build_serving_config
from serving.engine import Engine, State
from serving.guard import Gate
from serving.leftovers import remove_leftovers

log = logging.getLogger("serving")


CUT_GRACE_S = 2.0  # after the drain deadline: time for the cut requests' 503s to go out


class DrainingServer(uvicorn.Server):
    """uvicorn, with SageMaker's shutdown: the first SIGTERM/SIGINT drains, a second one
    stops at once. At the drain deadline the requests still running are cut (each
    answers the JSON 503, a stream ends with an error event), then the server stops
    and vLLM shuts down with nothing in flight. Also stops when the engine failed to start,
    and when it died (``engine_died``: requests in flight are cut at once, nothing can
    finish them)."""

    def __init__(self, config: uvicorn.Config, gate: Gate, engine: Engine, drain_s: float) -> None:
        super().__init__(config)
        self.gate, self.engine, self.drain_s = gate, engine, drain_s
        self.deadline = 0.0
        self.signal: int | None = None  # set by the first SIGTERM/SIGINT, logged by on_tick
        self.engine_died = False

    def handle_exit(self, sig, frame) -> None:
        """Runs as a Python signal handler, between two bytecodes of the main thread:
        flags only. No logging here: a handler that writes to stderr while the
        interrupted code is writing to it can raise ``RuntimeError: reentrant call`` out
        of whatever the event loop was doing (not observed here; a test of 200 signals
        against a process logging to a file never hit it), so on_tick logs instead."""
        if self.gate.draining:
            super().handle_exit(sig, frame)
            return
        self.signal = sig
        self.gate.draining = True
        self.deadline = time.monotonic() + self.drain_s

    async def on_tick(self, counter: int) -> bool:
        if self.signal is not None:  # logged here, on the event loop, not in the handler
            log.info(
                "signal %s: draining %d request(s) in flight (up to %.0f s)",
                self.signal,
                self.gate.in_flight,
                self.drain_s,
            )
            self.signal = None
        if not self.should_exit:
            now = time.monotonic()
            if not self.engine_died and self.engine.dead:
                self._engine_died(now)
            if self.gate.draining and self.gate.in_flight == 0:
                self._stop("drained: no request in flight")
            elif self.gate.draining and now >= self.deadline:
                if not self.gate.cut.is_set():
                    log.warning(
                        "%s: cutting %d request(s) still in flight (each answers 503)",
                        "the engine died" if self.engine_died else "drain deadline passed",
                        self.gate.in_flight,
                    )
                    self.gate.cut_all()
                elif now >= self.deadline + CUT_GRACE_S:
                    self._stop(f"{self.gate.in_flight} cut request(s) still open after {CUT_GRACE_S:.0f} s")
            elif self.engine.state is State.FAILED:
                self._stop(f"the engine failed: {self.engine.error}")
        return await super().on_tick(counter)

    def _engine_died(self, now: float) -> None:
        """The engine died while serving: drain with no grace (on_tick, event loop)."""
        log.error(
            "the engine died (see vLLM's log above): answering %d request(s) in flight "
            "with 503, then exiting 1 so that the server is replaced",
            self.gate.in_flight,
        )
        self.engine_died = self.gate.engine_died = self.gate.draining = True
        self.deadline = min(self.deadline, now) if self.deadline else now

    def _stop(self, why: str) -> None:
        """Stop listening and shut down (on_tick, event loop); the log says why."""
        log.info("stopping the server: %s", why)
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving", description=__doc__.splitlines()[0])
    p.add_argument("--print-config", action="store_true", help="print the configuration and tier plan, then exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_serving_config()
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(config.http.log_level)
    if args.print_config:
        print(config.describe())
        return 0
    log.info("configuration:\n%s", config.describe())
    remove_leftovers()  # what a killed predecessor's vLLM left in /dev/shm and /tmp

    app = create_app(config)
    engine: Engine = app.state.engine
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.http.host,
            port=config.http.port,
            log_level=config.http.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=3,
            timeout_keep_alive=config.http.keep_alive_s,
            lifespan="on",
        ),
        app.state.gate,
        engine,
        config.http.drain_timeout_s,
    )
    server.run()
    if engine.state is State.FAILED:
        print(f"engine failed: {engine.error}", file=sys.stderr)
        return 1
    if server.engine_died:
        print("engine died while serving: exiting 1", file=sys.stderr)
        return 1
    return 0


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown: the engine processes are already shut
    down, and tearing down vLLM's CPU/torch extension modules can stall for ~10 s,
    which SageMaker's 30 s SIGTERM budget cannot afford."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
