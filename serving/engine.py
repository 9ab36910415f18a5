"""The vLLM engine inside the server: start-up in the background, health, shutdown.

Runs in the server process. ``Engine.start`` is a task on the event loop; the slow
parts (importing vLLM, tens of seconds on a small machine; building ``AsyncLLM``,
which spawns the engine-core and worker processes and waits for the model to load)
run in a thread, so ``/ping`` keeps answering 503 meanwhile. Once ready, requests
go through vLLM's own OpenAI serving layer (``OpenAIServingChat`` and
``OpenAIServingCompletion``), built by vLLM's ``init_app_state`` from the same
arguments ``vllm serve`` takes. The engine client those objects see is wrapped by
``ObservedEngine``, which records each finished request's outcome for the metrics.
With ``KVCACHE_WARM_PROMPTS``, the warm-up (``serving.warmup``, an engine of its own in
a child process) runs to its end first, so two engines never share the memory.

``healthy`` reads two flags (ours and vLLM's ``errored``): no engine call, so it is
safe on the ``/ping`` path while the engine is busy.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from typing import Any, Callable, Optional

from cache.config import ConfigError
from serving.config import EngineSettings
from serving.metrics import RequestOutcome, now, outcome_from_output
from serving.warmup import Warmup

log = logging.getLogger(__name__)


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


def parse_engine_args(settings: EngineSettings):
    """vLLM's own CLI parser over our arguments; a bad one raises ``ConfigError``
    naming the variable that set it. Imports vLLM (slow): call it from a thread."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    sources = dict(settings.arg_sources)

    def fail(message: str):
        hint = [f"{flag} comes from {var}" for flag, var in sources.items()
                if flag in message or flag.replace("--", "--no-", 1) in message]
        raise ConfigError(f"vLLM rejects the engine arguments: {message}"
                          + (f" ({'; '.join(hint)})" if hint else ""))

    parser = make_arg_parser(FlexibleArgumentParser(prog="serving"))
    parser.error = fail  # type: ignore[method-assign]  # argparse would print usage and exit
    args = parser.parse_args(list(settings.vllm_args))
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as e:
        fail(str(e))
    return args


class ObservedEngine:
    """The engine client handed to vLLM's serving layer; sees every request's outputs.

    Everything but ``generate`` is passed through to ``AsyncLLM``.
    """

    def __init__(self, client: Any, on_finish: Callable[[RequestOutcome], None]) -> None:
        self._client = client
        self._on_finish = on_finish

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, *args: Any, **kwargs: Any):
        from vllm.sampling_params import RequestOutputKind

        params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
        delta = getattr(params, "output_kind", None) == RequestOutputKind.DELTA
        t0, ttft, generated = now(), None, 0
        stream = self._client.generate(*args, **kwargs)
        try:
            async for out in stream:
                n = sum(len(o.token_ids) for o in out.outputs)
                if ttft is None and n:
                    ttft = now() - t0
                generated = generated + n if delta else n
                if out.finished:
                    try:
                        self._on_finish(outcome_from_output(out, generated, ttft))
                    except Exception:  # metrics must never fail a request
                        log.exception("recording a request outcome failed")
                yield out
        finally:
            await stream.aclose()


class Engine:
    """Owns ``AsyncLLM`` and the OpenAI serving objects built on it."""

    def __init__(self, settings: EngineSettings, on_finish: Callable[[RequestOutcome], None],
                 startup_timeout_s: float = 600.0) -> None:
        self.settings = settings
        self.on_finish = on_finish
        self.startup_timeout_s = startup_timeout_s
        self.state = State.STARTING
        self.error: Optional[BaseException] = None
        self.client: Any = None           # vllm.v1.engine.async_llm.AsyncLLM
        self.chat: Any = None             # OpenAIServingChat
        self.completion: Any = None       # OpenAIServingCompletion
        self.max_model_len: Optional[int] = None
        self.warmup: Optional[Warmup] = None   # KVCACHE_WARM_PROMPTS, while it runs

    # -- health (the /ping path: flags only) ---------------------------------------
    @property
    def healthy(self) -> bool:
        if self.state is not State.READY:
            return False
        try:
            return not self.client.errored
        except Exception:
            return False

    # -- start-up --------------------------------------------------------------------
    async def start(self) -> None:
        """Start vLLM; on failure, ``state`` is FAILED and ``error`` says why."""
        try:
            await asyncio.wait_for(self._start(), timeout=self.startup_timeout_s)
            if self.state is State.STARTING:
                self.state = State.READY
                log.info("engine ready: serving %s", self.settings.served_model_name)
        except asyncio.TimeoutError:
            self._fail(TimeoutError(f"the engine was not ready within {self.startup_timeout_s:.0f} s "
                                    "(SAGEMAKER_STARTUP_TIMEOUT)"))
        except Exception as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        self.state, self.error = State.FAILED, e
        log.error("engine start-up failed: %s", e, exc_info=not isinstance(e, ConfigError))

    async def _start(self) -> None:
        for key, value in self.settings.env:
            os.environ.setdefault(key, value)
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
        from starlette.datastructures import State as AppState

        from vllm.entrypoints.launchers.api_server.app_state import init_app_state

        tasks = await self.client.get_supported_tasks()
        if "generate" not in tasks:
            raise ConfigError(f"model {self.settings.served_model_name} does not generate text "
                              f"(tasks: {tasks}); this server serves generative models")
        app_state = AppState()
        await init_app_state(ObservedEngine(self.client, self.on_finish), app_state, args, tasks)
        self.chat = app_state.openai_serving_chat
        self.completion = app_state.openai_serving_completion
        self.max_model_len = self.client.model_config.max_model_len

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
        if start_task is not None and not start_task.done():
            log.info("stopping during start-up: waiting up to %.0f s for it", timeout_s)
            await asyncio.wait({start_task}, timeout=timeout_s)
        if self.client is None:
            return
        client, self.client = self.client, None
        log.info("stopping the engine (was %s)", previous.value)
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
