"""The book's links stay true: every relative link in docs/ and the README points at a
file that exists, every code span naming a class, function or method in a linked
Python file names one that file defines, and every repository path written in a code
span exists."""

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
SYMBOL = re.compile(r"^`([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?`$")
PATH_SPAN = re.compile(r"`((?:numpitron|tests|benchmarks|docs)/[A-Za-z0-9_./-]+)`")


def defined_names(source: Path) -> set[str]:
    """Top-level functions and classes, and Class.method for every method."""
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)}
    return names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_named_code_exist(page):
    text, broken = page.read_text(), []
    for label, target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue                                    # a web address or an anchor on this page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(f"{label} -> {target}: no such file")
            continue
        symbol = SYMBOL.match(label)
        if symbol and path.suffix == ".py" and not label.endswith('.py`'):
            name = ".".join(part for part in symbol.groups() if part)
            if name not in defined_names(path):
                broken.append(f"{label} -> {target}: {name} is not defined there")
    for span in PATH_SPAN.findall(text):
        if not (REPO / span.rstrip("/")).exists():
            broken.append(f"`{span}`: no such path")
    assert not broken, "\n".join(broken)
