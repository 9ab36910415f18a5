"""vLLM's own ``vllm serve`` parser over the arguments ``serving.config`` rendered.

Runs in the server process (``serving.engine``, from a thread: importing vLLM takes
seconds) and in the warm-up child (``serving.warmup``). A leaf module of this package:
both of those import it, neither imports the other.
"""

from __future__ import annotations

from cache.config import ConfigError
from serving.config import EngineSettings


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
