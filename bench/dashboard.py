"""The Grafana dashboard's queries against a real Prometheus scraping a real server::

    python -m bench.dashboard --url http://127.0.0.1:8080 [--dashboard deploy/grafana/kvcache.json]

Starts Prometheus (Debian's ``prometheus`` package, or ``--prometheus PATH``) on a free
local port with a 1 s scrape of ``URL/metrics``, sends a little traffic to the server
(each prompt twice, so the tiers serve the repeats), waits for a few scrapes and runs
every query of the dashboard through Prometheus' HTTP API (``$__rate_interval`` and
``$__range`` taken as ``--window``). Prints one line per query: the panel, the legend,
how many series answered and one value. ``tests/test_server.py`` runs the same against
its server.

Also here, for that test: ``metric_names`` (the series a PromQL expression names) and
``exported_names`` (the series a ``/metrics`` page declares); for ``bench.capacity``,
``set_text_panel`` (its results in the dashboard's capacity panel).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.peers import free_port

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "kvcache.json"
# PromQL words that look like names: functions are followed by "(", these are not always.
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def queries(path: Path = DASHBOARD) -> list[tuple[str, str, str]]:
    """``(panel title, legend, expression)`` of every query of the dashboard."""
    dash = json.loads(Path(path).read_text())
    return [(p["title"], t.get("legendFormat", ""), t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The series an expression selects: names outside strings, label matchers, ranges,
    grouping lists and function calls."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in _NAME.finditer(text):
        word, after = m.group(), text[m.end() :].lstrip()[:1]
        if after == "(" or word.lower() in _KEYWORDS or word.startswith("$"):
            continue
        if m.start() > 0 and text[m.start() - 1] in "$.0123456789":
            continue
        names.add(word)
    return names


def exported_names(metrics_text: str) -> set[str]:
    """Every series name a ``/metrics`` page declares or shows, histogram and counter
    suffixes included (a labelled counter not yet incremented is declared, not shown)."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        if family.type == "counter":  # the parser strips the suffix the page declares
            names.add(family.name + "_total")
        else:
            names.add(family.name)
        if family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        names.update(sample.name for sample in family.samples)
    return names


class Prometheus:
    """A Prometheus process scraping ``target`` (``host:port``) every second."""

    def __init__(self, target: str, binary: Optional[str] = None) -> None:
        self.binary = binary or shutil.which("prometheus")
        if not self.binary:
            raise FileNotFoundError("prometheus is not installed (apt-get install prometheus)")
        self.dir = Path(tempfile.mkdtemp(prefix="kvcache-prom-"))
        (self.dir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs: [{{job_name: kvcache, static_configs: [{{targets: ['{target}']}}]}}]\n"
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(self.dir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address={self.url[len('http://') :]}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("prometheus did not start: " + (self.dir / "prometheus.log").read_text()[-2000:])
            time.sleep(0.3)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30).json()
        if r.get("status") != "success":
            raise ValueError(f"{expr}: {r.get('error')}")
        return r["data"]["result"]

    def scrapes(self) -> int:
        """Successful scrapes of the target so far."""
        got = self.query("count_over_time(up[10m])")
        return int(float(got[0]["value"][1])) if got else 0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def set_text_panel(title: str, content: str, path: Path = DASHBOARD) -> None:
    """Put ``content`` (markdown) in the dashboard's text panel titled ``title``. Plain file
    I/O, in the benchmark's process after a run (``bench.capacity``)."""
    dash = json.loads(Path(path).read_text())
    panels = [p for p in dash["panels"] if p.get("type") == "text" and p["title"] == title]
    if len(panels) != 1:
        raise ValueError(f"{path}: expected one text panel titled {title!r}, found {len(panels)}")
    panels[0].setdefault("options", {}).update(mode="markdown", content=content)
    Path(path).write_text(json.dumps(dash, indent=2, ensure_ascii=False))


def traffic(url: str, prompts: int = 3, pause_s: float = 1.0) -> None:
    """Each of ``prompts`` long prompts twice (the repeat is served from the tiers)."""
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(prompts):
            prompt = "".join(chr(97 + (j * (7 + 2 * i)) % 26) for j in range(1200 + 100 * i))
            for _ in range(2):
                r = client.post("/invocations", json={"prompt": prompt, "max_tokens": 2})
                r.raise_for_status()
                time.sleep(pause_s)


def answers(prom: Prometheus, window: str, path: Path = DASHBOARD) -> Iterator[tuple[str, str, str, list]]:
    """``(panel, legend, expression, result)`` of every dashboard query."""
    for title, legend, expr in queries(path):
        yield title, legend, expr, prom.query(expr.replace("$__rate_interval", window).replace("$__range", window))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__.split("::")[0])
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8080")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD)
    p.add_argument("--prometheus", default=None, help="the prometheus binary (default: on PATH)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--window", default="1m", help="what $__rate_interval and $__range stand for")
    args = p.parse_args(argv)
    target = args.url.split("://", 1)[-1].rstrip("/")
    with Prometheus(target, args.prometheus) as prom:
        traffic(args.url, args.prompts)
        time.sleep(5)
        empty = 0
        for title, legend, _expr, result in answers(prom, args.window, args.dashboard):
            value = result[0]["value"][1] if result else "-"
            empty += not result
            print(f"{title[:52]:<53}{legend[:34]:<35}{len(result):>3} series  {value}")
    print(f"{empty} queries without data (events that did not happen, or GPU-only series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
