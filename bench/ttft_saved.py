"""A ``bench.bench_ttft`` run of some scenarios keeps the saved run's other rows.

Runs in the benchmark's parent process, after the scenarios and before the summary.
``restore_rows`` puts the rows of a saved ``ttft.json`` that this run did not measure
back into the ``Bench`` (samples, hit tokens, details, errors as they were), and the
saved throughput rounds when throughput was not run, so the summary (floors, ratios
between rows, targets) covers every row again. Floors are recomputed with this run's
bandwidth measurements. Each table row carries ``measured``: when it was measured
(``stamp_rows``); rows of runs before these stamps say ``earlier run``.
"""

from __future__ import annotations

import time

EARLIER = "earlier run"


def restore_rows(bench, saved: dict, row_cls, throughput_run: bool) -> list[str]:
    """Saved rows this run did not measure, put back into ``bench.rows``; the saved
    throughput rounds into ``bench.tput`` unless ``throughput_run``. Returns the names
    of the restored rows. ``row_cls``: ``bench_ttft.Row``."""
    restored = []
    for r in saved.get("summary", {}).get("table", []):
        key = (r["scenario"], r["size"])
        if key in bench.rows or r["size"] not in bench.sizes:
            continue
        row = row_cls(r["scenario"], r["size"])
        row.samples_s = [ms / 1e3 for ms in r.get("samples_ms") or []]
        row.hit_tokens = list(r.get("hit_tokens") or [])
        row.detail = list(r.get("detail") or [])
        row.error = r.get("error") or ""
        bench.rows[key] = row
        bench.measured[key] = r.get("measured") or EARLIER
        restored.append(r["scenario"])
    tput = (saved.get("summary") or {}).get("throughput")
    if not throughput_run and tput and not getattr(bench, "tput", None):
        bench.tput = tput["rounds"]
    return sorted(set(restored))


def stamp_rows(bench, table: list[dict]) -> None:
    """Each summary row's ``measured``: this run's date for the rows it measured."""
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in table:
        r["measured"] = bench.measured.get((r["scenario"], r["size"]), now)
