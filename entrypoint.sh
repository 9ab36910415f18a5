#!/usr/bin/env bash
# Container entrypoint. SageMaker runs `docker run IMAGE serve`: that starts the server.
# `serve --print-config` (or just `--print-config`) passes options to the server.
# Any other command runs as given (`docker run IMAGE bash`, `... python -m cache.tools.footprint`).
# Both use exec, so the server (or the command) is PID 1 and receives SIGTERM directly.
set -euo pipefail

if [[ "${1:-serve}" == "serve" || "${1:-}" == -* ]]; then
    if [[ "${1:-}" == "serve" ]]; then shift; fi
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
    export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
    # The image's venv (docker/install.sh) is on PATH; in a checkout, prefer its .venv.
    python="${PYTHON:-}"
    if [[ -z "$python" ]]; then
        if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python=python3; fi
    fi
    exec "$python" -m serving "$@"
fi

exec "$@"
