"""Pre-warming at start-up (``KVCACHE_WARM_PROMPTS``): ``cache.tools.warm`` before serving.

``Warmup.run`` runs in the server process, on the event loop, inside ``Engine.start``,
before ``AsyncLLM`` is built. It starts ``python -m serving.warmup`` as a child process,
which parses the serving engine's own arguments with vLLM's parser (same model, engine
arguments and ``kv_connector_extra_config``, i.e. the same tier sizes and folders), runs
``cache.tools.warm.warm`` (its own vLLM engine with our connector: computes the prompts,
reads them back so they are published to the shared tier, shuts down flushing the
publish queue) and exits. Only then does the serving engine start: the two engines
never hold memory at the same time, and the child's exit releases everything the
warm-up engine held, whatever state it ended in.

Outcome: a bad prompts file (or anything ``warm`` reports as a configuration error)
stops start-up like any bad setting; any other failure is logged and the server
serves without the warm-up (a cold cache, not an outage). SIGTERM, or the start-up
timeout, during the warm-up ends the child (SIGTERM, so it shuts its engine down; its
whole process group is killed 5 s later if it has not). A server killed outright takes
the child with it (``prctl(PR_SET_PDEATHSIG)``, ``cache.vllm.plugin.die_with_parent``),
and the child's engine processes die with it the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
from typing import Any, Optional

from cache.errors import ConfigError
from cache.vllm.plugin import die_with_parent
from serving.config import EngineSettings

log = logging.getLogger(__name__)

BATCH_SIZE = 16  # prompts per batch (cache.tools.warm's default); a batch must fit L1 + L2
KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL of the warm-up's process group
EXIT_CONFIG_ERROR = 2


class Warmup:
    """One warm-up run in a child process; ``kill`` may be called from anywhere on the loop."""

    def __init__(self, settings: EngineSettings, batch_size: int = BATCH_SIZE) -> None:
        assert settings.warm_prompts
        self.settings = settings
        self.batch_size = batch_size
        self._proc: Optional[asyncio.subprocess.Process] = None
        self._killed = False

    async def run(self) -> Optional[dict]:
        """The warm report (``prompts``, ``tokens``, ``seconds``, ``reloaded`` per tier), or
        None when the warm-up failed or was killed. Raises ``ConfigError`` for a file or
        setting the warm-up cannot use."""
        path = self.settings.warm_prompts
        log.info(
            "warm-up: warming the cache with %s (KVCACHE_WARM_PROMPTS) in an engine of its "
            "own; the serving engine starts when it is done",
            path,
        )
        with tempfile.TemporaryDirectory(prefix="kvcache-warm-") as tmp:
            report_path = os.path.join(tmp, "report.json")
            job = {
                "prompts": path,
                "batch_size": self.batch_size,
                "report": report_path,
                "parent_pid": os.getpid(),  # the child dies with us (die_with_parent)
                "vllm_args": list(self.settings.vllm_args),
                "arg_sources": [list(p) for p in self.settings.arg_sources],
            }
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "serving.warmup",
                stdin=asyncio.subprocess.PIPE,
                env=_child_env(),
                start_new_session=True,
            )  # its own group: killable as a whole
            try:
                await self._proc.communicate(json.dumps(job).encode())
            except BaseException:  # cancelled (start-up timeout): the child must not outlive us
                self.kill()
                await asyncio.shield(self._proc.wait())
                raise
            _kill_group(self._proc)  # whatever the child left running (it crashed): gone now
            code = self._proc.returncode
            report = _read_json(report_path)
        if self._killed:
            log.info("warm-up stopped before it finished")
            return None
        if code == EXIT_CONFIG_ERROR and report.get("error"):
            raise ConfigError(f"KVCACHE_WARM_PROMPTS={path!r}: {report['error']}")
        if code != 0 or "prompts" not in report:
            log.error(
                "warm-up failed (exit code %s%s); serving without it",
                code,
                f": {report['error']}" if report.get("error") else "; see the log above",
            )
            return None
        reloaded = report.get("reloaded") or {}
        published = sum(n for tier, n in reloaded.items() if tier != "shared")
        log.info(
            "warm-up done: %d prompts, %d tokens in %.1f s; %d tokens published to the shared "
            "tier now, %d were shared already (tokens read back per tier: %s)",
            report["prompts"],
            report["tokens"],
            report["seconds"],
            published,
            reloaded.get("shared", 0),
            reloaded or "none",
        )
        return report

    def kill(self) -> None:
        """End the warm-up: SIGTERM to the child (it shuts its engine down), SIGKILL to its
        process group after ``KILL_GRACE_S``."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        self._killed = True
        log.info("warm-up: stopping it")
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        asyncio.get_running_loop().call_later(KILL_GRACE_S, _kill_group, proc)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and the engine processes it started
    except (ProcessLookupError, PermissionError):
        pass


def _child_env() -> dict[str, str]:
    """The server's environment (``KVCACHE_*``, ``HF_TOKEN``, the engine variables set by
    ``Engine``), with this project importable however the server was started."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


# -- the child process --------------------------------------------------------------
def warm_arguments(args) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(model, cache settings, vllm.LLM arguments)`` for ``cache.tools.warm.warm`` from the
    serving engine's parsed ``vllm serve`` arguments: the same engine, but with the
    connector and prefix caching that ``warm`` sets itself."""
    from vllm.engine.arg_utils import EngineArgs

    engine_args = dict(vars(EngineArgs.from_cli_args(args)))
    model = engine_args.pop("model")
    transfer = engine_args.pop("kv_transfer_config", None)
    for name in (
        "enable_prefix_caching",  # warm turns it on (it resets it between passes)
        "disable_log_stats",
    ):  # vllm.LLM's default: no stats
        engine_args.pop(name, None)
    cache = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    return model, cache, engine_args


def main() -> int:
    """``python -m serving.warmup`` < job JSON: run ``cache.tools.warm.warm``, write the report."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM ends the warm-up through warm()'s own shutdown path (engine shut down).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    job = json.load(sys.stdin)
    die_with_parent(job.get("parent_pid"))  # a server killed with -9 takes its warm-up along
    code, report = 0, {}
    try:
        from cache.tools.warm import warm
        from serving.engine_args import parse_engine_args

        settings = EngineSettings(
            vllm_args=tuple(job["vllm_args"]), arg_sources=tuple(tuple(p) for p in job["arg_sources"])
        )
        model, cache, engine_args = warm_arguments(parse_engine_args(settings))
        r = warm(job["prompts"], model, cache=cache, batch_size=job["batch_size"], **engine_args)
        report = {"prompts": r.prompts, "tokens": r.tokens, "seconds": round(r.seconds, 2), "reloaded": r.reloaded}
    except (ConfigError, ValueError, OSError) as e:  # the file, a prompt in it, or a setting
        log.error("warm-up: %s", e)
        code, report = EXIT_CONFIG_ERROR, {"error": str(e)}
    except Exception as e:
        log.exception("warm-up failed")
        code, report = 1, {"error": f"{type(e).__name__}: {e}"}
    with open(job["report"], "w") as f:
        json.dump(report, f)
    return code


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the server does: no slow interpreter teardown after vLLM
