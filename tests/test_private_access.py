"""No module reaches into another object's private members (``other._name``): what a module
drives it drives through that object's public interface. Static checks over the source
(AST). Modules are held to it one by one, as they are cleaned up (issue 29)."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO

# Modules held to the rule.
CLEAN = (
    "cache/store/accounting.py",
    "cache/store/background.py",
    "cache/store/placement.py",
    "cache/store/publisher.py",
    "cache/store/reads.py",
    "cache/store/tiered.py",
    "cache/store/writer.py",
    "cache/vllm/layered.py",
    "cache/vllm/load_path.py",
    "cache/vllm/worker.py",
)


def private_accesses(tree: ast.AST) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self`` or ``cls`` (dunders are public): each as
    ``line: source``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", CLEAN)
def test_no_access_to_another_objects_private_members(path):
    tree = ast.parse((REPO / path).read_text(), path)
    assert private_accesses(tree) == [], f"{path} reaches into private members of what it drives"


def test_the_detector_sees_private_accesses():
    tree = ast.parse("self._own\nself.worker._lock\nw._fill(c)\nx.__class__\ncls._registry\n")
    assert private_accesses(tree) == ["2: self.worker._lock", "3: w._fill"]
