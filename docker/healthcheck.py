"""The images' Docker HEALTHCHECK: healthy when the server's ``GET /ping`` answers 200.

Runs inside the container, started by Docker (``docker ps`` shows the verdict); SageMaker
probes ``/ping`` itself and ignores Docker's health state. Standard library only, one
request, a few seconds at most. Exit 0 healthy, 1 not (one line on stderr saying why).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def ping_url(env=os.environ) -> str:
    host = env.get("SERVING_HOST") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):  # listening everywhere: ask over loopback
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{env.get('SAGEMAKER_BIND_TO_PORT') or '8080'}/ping"


def main() -> int:
    url = ping_url()
    try:
        with urllib.request.urlopen(url, timeout=4) as answer:
            status = answer.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError as e:
        print(f"healthcheck: {url}: {e}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"healthcheck: {url} answered {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
