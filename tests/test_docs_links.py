"""The README, docs and deployment files point at things that exist: every relative link in
the Markdown files (and its #anchor), every repository path named in any tracked file, and
every KVCACHE_* setting the deployment files and docs name. The README stays a short
entry point (the two commands first, at most 250 lines) from which every document and
every section that moved out of it is reachable, and the benchmark summaries in
bench/README.md are what the bench scripts write there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cache.config import DEPRECATED

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A repository path: one of the top folders, then a file name with an extension.
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:docs|deploy|docker|bench|cache|serving|tests)/"
    r"[\w./-]*\w\.(?:md|ya?ml|py|sh|json|toml|cpu|gpu))\b"
)


def tracked(pattern: str = "") -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", *([pattern] if pattern else [])], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
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
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
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


# The deployment files (owned with the images) and the docs (docs/settings.md documents
# every setting), and the README.
DEPLOY_FILES = ["docs", "deploy", "docker", "buildspec.yml"]
RENAMED = DEPRECATED  # old setting name -> new one
# The one paragraph that names the old settings, to say they still work, and its file.
DEPRECATION_NOTE = re.compile(r"The names of an earlier release.*?\n\n", re.S)
NOTE_FILE = REPO / "docs" / "settings.md"


def settings_named(paths: list[str]) -> dict[str, set[str]]:
    where: dict[str, set[str]] = {}
    for entry in paths:
        root = REPO / entry
        files = [root] if root.is_file() else [p for p in tracked() if root in p.parents]
        for f in files:
            if "schemas" in f.parts:
                continue
            text = f.read_text()
            if f == NOTE_FILE:
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
    unknown = {
        name: sorted(files)
        for name, files in settings_named(DEPLOY_FILES + ["README.md"]).items()
        if name not in _CODE and name not in RENAMED
    }
    assert not unknown, unknown


def test_every_cache_setting_has_a_row_in_the_settings_doc():
    from cache.config import SETTINGS

    text = NOTE_FILE.read_text()
    assert not [name for name in SETTINGS if f"| `{name}`" not in text]


def test_the_deprecation_note_is_where_the_check_skips_it():
    assert len(DEPRECATION_NOTE.findall(NOTE_FILE.read_text())) == 1


# -- the README: a short entry point to everything else ---------------------------------------
README = REPO / "README.md"
TWO_COMMANDS = [
    "bash docker/install.sh cpu && .venv/bin/python -m serving",
    "bash docker/install.sh cpu && .venv/bin/python -m pytest -q",
]
# Sections that moved out of the README when it became an entry point (issue 29): each must
# be a heading of a document that the README links to, by its anchor.
MOVED = {
    "docs/design.md": [
        "how-a-request-uses-the-cache",
        "hybrid-models-sliding-window-mamba",
        "the-shared-tier-on-curvine",
        "kv-cache-events-for-routers",
        "eviction-policy",
    ],
    "docs/api.md": ["run-it", "routes", "errors", "shutdown", "using-the-connector-with-plain-vllm"],
    "docs/settings.md": [
        "model",
        "engine-vllm",
        "http-read-through-the-sagemaker-inference-toolkit-where-it-knows-them",
        "kv-cache-tiers",
        "pre-warming",
        "sizing",
        "sizing-from-live-traffic",
    ],
    "docs/metrics.md": [],
    "docs/operations.md": ["why-a-request-missed"],
    "docs/deploy.md": ["images", "codebuild--ecr", "deploy"],
    "bench/README.md": ["results", "eviction-policy"],
}


def links_of(doc: Path) -> set[tuple[Path, str]]:
    """``(file, anchor)`` of every relative link in ``doc`` (anchor '' when none)."""
    out = set()
    for _, line in prose_lines(doc):
        for target in LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                path, _, anchor = target.partition("#")
                out.add(((doc.parent / path).resolve() if path else doc, anchor))
    return out


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    sections = re.findall(r"^## (.*)$", text, re.M)
    assert sections[0] == "Two commands", sections
    first = text.split("\n## ", 2)[1]
    assert re.findall(r"```bash\n(.*?)\n```", first) == TWO_COMMANDS


def test_every_moved_section_is_linked_from_the_readme():
    linked = links_of(README)
    missing = [
        f"{doc}#{anchor}"
        for doc, anchors_ in MOVED.items()
        for anchor in [""] + anchors_
        if ((REPO / doc).resolve(), anchor) not in linked
    ]
    assert not missing, f"README.md does not link to: {missing}"
    gone = [f"{doc}#{a}" for doc, anchors_ in MOVED.items() for a in anchors_ if a not in anchors(REPO / doc)]
    assert not gone, f"no such heading: {gone}"


def test_every_document_is_reachable_from_the_readme():
    """Following relative links from the README reaches every tracked Markdown file."""
    seen, todo = set(), [README.resolve()]
    while todo:
        doc = todo.pop()
        if doc not in seen:
            seen.add(doc)
            todo += [p for p, _ in links_of(doc) if p.suffix == ".md" and p.exists()]
    unreached = sorted(str(p.relative_to(REPO)) for p in MARKDOWN if p.resolve() not in seen)
    assert not unreached, unreached


def test_bench_summaries_are_what_the_scripts_write_in_bench_readme():
    """Each summary between its markers is what its script renders from the committed
    results (so a run rewrites it there, with links relative to bench/), and the top-level
    README holds none."""
    import json

    from bench import bench_policy, bench_ttft, readme, ttft_partial

    assert readme.README == REPO / "bench" / "README.md"
    results = REPO / "bench" / "results"
    rendered = {
        "bench_ttft": bench_ttft.readme_section(json.loads((results / "ttft.json").read_text())),
        "ttft_partial": ttft_partial.readme_section(json.loads((results / "ttft_partial.json").read_text())),
        "bench_policy": bench_policy.readme_section(json.loads((results / "policy.json").read_text())),
    }
    text = readme.README.read_text()
    for name, body in rendered.items():
        begin, end = readme.markers(name)
        assert text.count(begin) == 1 and text.count(end) == 1, name
        assert text.split(begin)[1].split(end)[0].strip() == body.strip(), name
        assert begin not in README.read_text()
