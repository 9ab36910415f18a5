"""vLLM's own ``vllm serve`` parser over the arguments ``serving.config`` rendered.

Runs in the server process (``serving.engine``, from a thread: importing vLLM takes
seconds) and in the warm-up child (``serving.warmup``). A leaf module of this package:
both of those import it, neither imports the other.
"""

from __future__ import annotations

import logging

from cache.errors import ConfigError
from serving.config import EngineSettings

log = logging.getLogger(__name__)


def known_lmi_options(settings: EngineSettings, known: set[str]) -> list[str]:
    """The arguments without those an ``OPTION_*`` variable set that vLLM does not know:
    LMI takes options for its other engines too, so they are dropped with a note rather
    than stopping vLLM. Unknown ``SM_VLLM_*`` arguments stay (vLLM's parser refuses them
    by name): those are meant for vLLM."""
    sources = dict(settings.arg_sources)
    out: list[str] = []
    args = list(settings.vllm_args)
    i = 0
    while i < len(args):
        token = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        name = token if token in sources else "--" + token[len("--no-") :]
        var = sources.get(name, "")
        if token.startswith("--") and var.startswith("OPTION_") and token not in known:
            log.info("%s: vLLM has no %s; ignored (an LMI option for another engine)", var, token)
        else:
            out += args[i : i + 2] if takes_value else [token]
        i += 2 if takes_value else 1
    return out


def parse_engine_args(settings: EngineSettings):
    """vLLM's own CLI parser over our arguments; a bad one raises ``ConfigError``
    naming the variable that set it. Imports vLLM (slow): call it from a thread."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    sources = dict(settings.arg_sources)

    def fail(message: str):
        hint = [
            f"{flag} comes from {var}"
            for flag, var in sources.items()
            if flag in message or flag.replace("--", "--no-", 1) in message
        ]
        raise ConfigError(f"vLLM rejects the engine arguments: {message}" + (f" ({'; '.join(hint)})" if hint else ""))

    parser = make_arg_parser(FlexibleArgumentParser(prog="serving"))
    parser.error = fail  # argparse would print usage and exit
    # argparse lists its option strings only in this attribute.
    args = parser.parse_args(known_lmi_options(settings, set(parser._option_string_actions)))  # noqa: SLF001
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as e:
        fail(str(e))
    return args
