"""The README, docs and deployment files point at things that exist: every relative link in
the Markdown files (and its #anchor), every repository path named in any tracked file, and
every KVCACHE_* setting the deployment files and docs name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cache.config import DEPRECATED

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A repository path: one of the top folders, then a file name with an extension.
REPO_PATH = re.compile(r"(?<![\w/.-])((?:docs|deploy|docker|bench|cache|serving|tests)/[\w./-]*\w\.(?:md|ya?ml|py|sh|json|toml|cpu|gpu))\b")


def tracked(pattern: str = "") -> list[Path]:
    out = subprocess.run(["git", "ls-files", *([pattern] if pattern else [])], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return [REPO / p for p in out if (REPO / p).is_file()]


def prose_lines(path: Path):
    """(line number, text) of a Markdown file outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for _, line in prose_lines(path):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


MARKDOWN = tracked("*.md")


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = []
    for number, line in prose_lines(doc):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}:{number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.name}:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_repository_paths_named_anywhere_exist():
    missing = []
    for path in tracked():
        if path.suffix in (".png", ".svg", ".jsonl") or "schemas" in path.parts:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for name in set(REPO_PATH.findall(text)):
            if not (REPO / name).exists():
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, "\n".join(sorted(missing))


# The deployment files (owned with the images) and the README, which documents every setting.
DEPLOY_FILES = ["docs", "deploy", "docker", "buildspec.yml"]
RENAMED = DEPRECATED  # old setting name -> new one
# The one README paragraph that names the old settings, to say they still work.
DEPRECATION_NOTE = re.compile(r"The names of an earlier release.*?\n\n", re.S)


def settings_named(paths: list[str]) -> dict[str, set[str]]:
    where: dict[str, set[str]] = {}
    for entry in paths:
        root = REPO / entry
        files = [root] if root.is_file() else [p for p in tracked() if root in p.parents]
        for f in files:
            if "schemas" in f.parts:
                continue
            text = f.read_text()
            if f.name == "README.md":
                text = DEPRECATION_NOTE.sub("", text)
            for name in re.findall(r"\bKVCACHE_[A-Z0-9_]*[A-Z0-9]\b", text):
                where.setdefault(name, set()).add(str(f.relative_to(REPO)))
    return where


def renamed_in(paths: list[str]) -> list[str]:
    return [f"{n} (now {RENAMED[n]}) in {sorted(f)}" for n, f in settings_named(paths).items() if n in RENAMED]


def test_deployment_files_use_the_current_setting_names():
    assert not renamed_in(DEPLOY_FILES)


_CODE = "\n".join(p.read_text() for p in tracked("*.py") if p.parts[len(REPO.parts)] in ("cache", "serving"))


def test_every_setting_the_docs_name_is_read_by_the_code():
    """Once the code reads the new names: the README too uses them, and no deployment file
    or doc names a setting the code does not read."""
    assert not renamed_in(["README.md"])
    unknown = {name: sorted(files) for name, files in settings_named(DEPLOY_FILES + ["README.md"]).items()
               if name not in _CODE and name not in RENAMED}
    assert not unknown, unknown
