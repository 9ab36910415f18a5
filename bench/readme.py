"""The benchmark summaries of ``bench/README.md`` ("Results"): each lies between a begin
and an end marker and is rewritten whole by the script that measured it (``bench_ttft``,
``ttft_partial``, ``bench_policy``); their links are relative to ``bench/``. The top-level
README links to them and holds none. Runs in those scripts' processes, after a run; plain
file I/O."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"  # bench/README.md


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of script ``name``'s section."""
    return (f"<!-- {name}: begin (written by python -m bench.{name}; do not edit) -->", f"<!-- {name}: end -->")


def replace_section(name: str, body: str, readme: Path = README) -> bool:
    """Put ``body`` between ``name``'s markers in ``readme``; False when they are missing."""
    begin, end = markers(name)
    text = readme.read_text()
    if begin not in text or end not in text:
        return False
    before, rest = text.split(begin, 1)
    readme.write_text(f"{before}{begin}\n\n{body}\n\n{end}{rest.split(end, 1)[1]}")
    return True
