"""The vLLM engine inside the server: start-up in the background, health, shutdown.

Runs in the server process. ``Engine.start`` is a task on the event loop; the slow
parts (an S3 model's download, importing vLLM, tens of seconds on a small machine;
building ``AsyncLLM``, which spawns the engine-core and worker processes and waits for
the model to load) run in threads, so ``/ping`` keeps answering 503 meanwhile. Once
ready, vLLM's ``init_app_state`` builds its OpenAI serving layer (``OpenAIServingChat``,
``OpenAIServingCompletion``, the models list, the pooling endpoints when the model
pools) from the same arguments ``vllm serve`` takes, into the app's own state, where
``serving.pipeline`` and vLLM's endpoint functions find them. The engine client those
objects see is wrapped by ``ObservedEngine``, which records each finished request's
outcome for the metrics. With ``KVCACHE_WARM_PROMPTS``, the warm-up
(``serving.warmup``, an engine of its own in a child process) runs to its end first,
so two engines never share the memory. With ``KVCACHE_WARM_DRAM``, once the engine is
ready, the DRAM warm-up (``serving.dram_warm``) runs before ``/ping`` reports healthy
(``warming``), until the start-up deadline at most; requests are served meanwhile.

``healthy`` and ``dead`` read two flags (ours and vLLM's ``errored``): no engine call,
so they are safe on the ``/ping`` path while the engine is busy.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from typing import Any, Callable, Optional

from cache.errors import ConfigError
from serving.config import EngineSettings
from serving.dram_warm import DramWarm
from serving.engine_args import parse_engine_args
from serving.leftovers import engine_ready
from serving.metrics import RequestOutcome, now, outcome_from_output
from serving.model import fetch_model
from serving.warmup import Warmup
from serving.weights import with_weights_fingerprint


class _State:
    """An attribute bag, for an engine used without an app (tests)."""


log = logging.getLogger(__name__)


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


class ObservedEngine:
    """The engine client handed to vLLM's serving layer; sees every request's outputs.

    Everything but ``generate`` is passed through to ``AsyncLLM``. ``in_flight``: the
    ``generate`` streams open now (event loop only, so a plain int), which each request's
    outcome carries as the load it arrived at.
    """

    def __init__(self, client: Any, on_finish: Callable[[RequestOutcome], None]) -> None:
        self._client = client
        self._on_finish = on_finish
        self.in_flight = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, *args: Any, **kwargs: Any):
        from vllm.sampling_params import RequestOutputKind

        params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
        t0, ttft, generated = now(), None, 0
        stream = self._client.generate(*args, **kwargs)
        self.in_flight += 1
        arrived_at = self.in_flight
        try:
            async for out in stream:
                n = sum(len(o.token_ids) for o in out.outputs)
                if ttft is None and n:
                    ttft = now() - t0
                generated = generated + n if delta else n
                if out.finished:
                    try:
                        self._on_finish(outcome_from_output(out, generated, ttft, arrived_at))
                    except Exception:  # metrics must never fail a request
                        log.exception("recording a request outcome failed")
                yield out
        finally:
            self.in_flight -= 1
            await stream.aclose()


class Engine:
    """Owns ``AsyncLLM`` and the OpenAI serving objects built on it."""

    def __init__(
        self,
        settings: EngineSettings,
        on_finish: Callable[[RequestOutcome], None],
        startup_timeout_s: float = 600.0,
        vllm_state: Any = None,
    ) -> None:
        self.settings = settings
        self.on_finish = on_finish
        self.startup_timeout_s = startup_timeout_s
        self.state = State.STARTING
        self.error: Optional[BaseException] = None
        self.client: Any = None  # vllm.v1.engine.async_llm.AsyncLLM
        # Where vLLM's init_app_state puts its serving objects (OpenAIServingChat ...):
        # the app's own state, so that vLLM's endpoint functions, which look them up on
        # ``request.app.state``, find them.
        self.vllm_state: Any = vllm_state if vllm_state is not None else _State()
        self.tasks: tuple[str, ...] = ()
        self.model_config: Any = None
        self.max_model_len: Optional[int] = None
        self.warmup: Optional[Warmup] = None  # KVCACHE_WARM_PROMPTS, while it runs
        self.dram_warm: Optional[DramWarm] = None  # KVCACHE_WARM_DRAM, once the engine is ready

    # -- health (the /ping path: flags only) ---------------------------------------
    @property
    def healthy(self) -> bool:
        if self.state is not State.READY:
            return False
        try:
            return not self.client.errored
        except Exception:
            return False

    @property
    def warming(self) -> bool:
        """The DRAM warm-up is under way (``/ping`` says 503 until it ends). A flag."""
        return self.dram_warm is not None and not self.dram_warm.finished

    @property
    def dead(self) -> bool:
        """The engine was serving and died (its engine-core process exited or failed:
        vLLM's ``errored``). Flags only; the server then exits (``serving.__main__``)."""
        if self.state is not State.READY or self.client is None:
            return False
        try:
            return bool(self.client.errored)
        except Exception:
            return True

    # -- start-up --------------------------------------------------------------------
    async def start(self) -> None:
        """Start vLLM; on failure, ``state`` is FAILED and ``error`` says why. Then the DRAM
        warm-up, when asked for, within what is left of the start-up timeout."""
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._start(), timeout=self.startup_timeout_s)
            if self.state is State.STARTING:
                self.state = State.READY
                log.info("engine ready: serving %s", self.settings.served_model_name)
        except asyncio.TimeoutError:
            self._fail(
                TimeoutError(
                    f"the engine was not ready within {self.startup_timeout_s:.0f} s (SAGEMAKER_STARTUP_TIMEOUT)"
                )
            )
        except Exception as e:
            self._fail(e)
        if self.state is State.READY and self.settings.warm_dram_bytes:
            self.dram_warm = DramWarm(self.settings, started + self.startup_timeout_s)
            await self.dram_warm.run(self.client)

    def _fail(self, e: BaseException) -> None:
        self.state, self.error = State.FAILED, e
        log.error("engine start-up failed: %s", e, exc_info=not isinstance(e, ConfigError))

    async def _start(self) -> None:
        for key, value in self.settings.env:
            os.environ.setdefault(key, value)
        source = self.settings.model_source
        if source is not None and source.s3_uri:  # an S3 model: its files, before vLLM starts
            await asyncio.to_thread(fetch_model, source)
        # The weights' fingerprint (cache namespace), once for every engine process.
        self.settings = await asyncio.to_thread(with_weights_fingerprint, self.settings)
        args = await asyncio.to_thread(parse_engine_args, self.settings)
        if self.state is State.STOPPING:
            return
        if self.settings.warm_prompts:
            # Before the serving engine, never beside it: the warm-up engine's process tree
            # has exited (its memory released) when run() returns.
            self.warmup = Warmup(self.settings)
            try:
                await self.warmup.run()
            finally:
                self.warmup = None
            if self.state is State.STOPPING:
                return
        self.client = await asyncio.to_thread(_build_async_llm, args)
        if self.state is State.STOPPING:  # SIGTERM arrived during start-up: stop() shuts it down
            return
        await asyncio.to_thread(engine_ready)  # hold our engine's file store; clean up again
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        self.tasks = tuple(await self.client.get_supported_tasks())
        await init_app_state(ObservedEngine(self.client, self.on_finish), self.vllm_state, args, self.tasks)
        self.model_config = self.client.model_config
        self.max_model_len = self.model_config.max_model_len

    @property
    def chat(self) -> Any:
        """vLLM's ``OpenAIServingChat`` (None for a model that does not generate)."""
        return getattr(self.vllm_state, "openai_serving_chat", None)

    @property
    def completion(self) -> Any:
        return getattr(self.vllm_state, "openai_serving_completion", None)

    @property
    def models(self) -> Any:
        """vLLM's ``OpenAIServingModels``: the served name and any LoRA adapters."""
        return getattr(self.vllm_state, "openai_serving_models", None)

    def invocation_types(self) -> list:
        """vLLM's SageMaker dispatch list for this model's tasks: ``(request model,
        (get_handler, endpoint))`` pairs, generation first, then pooling, in vLLM's order."""
        from vllm.entrypoints.generate.factories import get_generate_invocation_types
        from vllm.entrypoints.pooling.factories import get_pooling_invocation_types

        return get_generate_invocation_types(self.tasks, self.model_config) + get_pooling_invocation_types(
            self.tasks, self.model_config
        )

    # -- shutdown ----------------------------------------------------------------------
    async def stop(self, timeout_s: float = 10.0, start_task: Optional[asyncio.Task] = None) -> None:
        """Shut vLLM down: its workers close their stores, which flushes the write-behind.

        If start-up is still under way, it gets ``timeout_s`` to finish (the engine
        processes must not be orphaned) and is shut down right after.
        """
        previous = self.state
        if previous is not State.FAILED:  # a failed start stays visible (exit code 1)
            self.state = State.STOPPING
        if self.warmup is not None:  # a warm-up is cut short: the server is going away
            self.warmup.kill()
        if self.dram_warm is not None:
            self.dram_warm.cancel()
        if start_task is not None and not start_task.done():
            log.info("stopping during start-up: waiting up to %.0f s for it", timeout_s)
            await asyncio.wait({start_task}, timeout=timeout_s)
        if self.client is None:
            return
        client, self.client = self.client, None
        log.info("stopping the engine (was %s)", previous.value)
        # vLLM cancels its output handler only after the engine core is gone; meanwhile
        # the handler reads the dead core and logs an EngineDeadError traceback. Nothing
        # is in flight any more (the server drained or cut every request): cancel it first.
        handler = getattr(client, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
        await asyncio.to_thread(client.shutdown, timeout_s)


def _build_async_llm(args):
    """``AsyncLLM`` from parsed ``vllm serve`` arguments. Blocks until the model is loaded."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    engine_args = AsyncEngineArgs.from_cli_args(args)
    usage = UsageContext.OPENAI_API_SERVER
    vllm_config = engine_args.create_engine_config(usage_context=usage)
    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=usage,
        enable_log_requests=engine_args.enable_log_requests,
        aggregate_engine_logging=engine_args.aggregate_engine_logging,
        disable_log_stats=engine_args.disable_log_stats,
        # Stats always reach Prometheus: with --disable-log-stats vLLM would keep none, and
        # ``/metrics`` would lose vLLM's series and the connector's kvcache:tier_* (observed
        # on this path). With this logger alone, only the stats log lines stay off.
        stat_loggers=[PrometheusStatLogger] if engine_args.disable_log_stats else None,
    )
