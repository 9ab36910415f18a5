"""Checked style (issue 29 item 5): ruff's formatter and lint rules over the tree and mypy over
cache/ and serving/, all as pyproject.toml configures them, so the README's test command and CI
(``.ci/run``) run them. Both are test dependencies (``docker/install.sh``); each check
takes a few seconds (mypy keeps an incremental cache in ``.mypy_cache``).

One rule is a structure rule as well: no code reaches into another class's private
members (ruff's SLF001), allowed only in the files that issue 29 items 1 and 2 rewrite."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# Files allowed to touch other classes' private members, each with its reason; an entry
# goes when the rewrite it waits for lands (the rule then covers that file too).
SLF001_ALLOWED: dict[str, str] = {}


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError as e:  # pragma: no cover - the interpreter itself is missing
        raise AssertionError(f"cannot run {args[0]}: {e}") from None


def _require(tool: str) -> None:
    out = _run(tool, "--version")
    assert out.returncode == 0, (
        f"{tool} is not installed in {sys.prefix}: it is a test dependency "
        f"(bash docker/install.sh cpu installs it)\n{out.stderr}"
    )


def test_ruff_check_passes():
    _require("ruff")
    out = _run("ruff", "check", "--no-fix", "--output-format", "concise", ".")
    assert out.returncode == 0, (
        "ruff check found problems (`ruff check --fix` repairs the safe ones):\n" + out.stdout + out.stderr
    )


def test_the_tree_is_formatted():
    _require("ruff")
    out = _run("ruff", "format", "--check", ".")
    assert out.returncode == 0, "files not formatted (`ruff format` formats them):\n" + out.stdout + out.stderr


def test_the_format_check_catches_a_file_left_unformatted(tmp_path):
    _require("ruff")
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "mod.py").write_text("x = {'a':1}\n")
    out = _run("ruff", "format", "--check", "mod.py", cwd=tmp_path)
    assert out.returncode == 1 and "mod.py" in out.stdout, out.stdout + out.stderr


def test_mypy_passes():
    _require("mypy")
    out = _run("mypy")  # files, plugins and per-module settings: [tool.mypy] in pyproject.toml
    assert out.returncode == 0, "mypy found type errors:\n" + out.stdout + out.stderr


def test_private_member_rule_is_on_everywhere_but_the_listed_files():
    lint = PYPROJECT["tool"]["ruff"]["lint"]
    assert "SLF001" in lint["select"] and "SLF001" not in lint.get("ignore", [])
    allowed = {path for path, codes in lint.get("per-file-ignores", {}).items() if "SLF001" in codes}
    assert allowed == set(SLF001_ALLOWED), "a new SLF001 allowance needs a reason in SLF001_ALLOWED"


def test_private_member_rule_catches_a_reach_into_another_object(tmp_path):
    """The rule as configured flags ``other._private`` and lets ``self._own`` pass."""
    _require("ruff")
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "mod.py").write_text(
        textwrap.dedent("""\
        class A:
            def __init__(self, other: "A") -> None:
                self._own = 1
                self.theirs = other._own
        """)
    )
    out = _run("ruff", "check", "--no-fix", "--output-format", "concise", "mod.py", cwd=tmp_path)
    assert out.returncode == 1 and "mod.py:4:" in out.stdout and "SLF001" in out.stdout, out.stdout + out.stderr
    assert out.stdout.count("SLF001") == 1, out.stdout
