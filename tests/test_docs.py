"""The book's links stay true: every relative link in docs/ and the README points at a
file that exists, every code span naming a class, function or method in a linked
Python file names one that file defines, and every repository path written in a code
span exists; and every import in the package goes downward through the architecture
page's table of the house. Every figure a page names is drawn again by `make figures`."""

import ast
import re
import subprocess
import sys
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


def house_rows() -> list[list[str]]:
    """The paths named in each row of docs/architecture.md's table of the house, top first."""
    section = (REPO / "docs/architecture.md").read_text().split("## The house")[1].split("\n## ")[0]
    cells = [line.split("|") for line in section.splitlines() if line.startswith("| ")]
    return [paths for row in cells if (paths := re.findall(r"`([^`]+)`", row[2]))]


def row_of(path: str, rows: list[list[str]]) -> int | None:
    """The row naming the file, or else the deepest directory holding it."""
    matches = [(len(named), i) for i, paths in enumerate(rows) for named in paths
               if path == named or (named.endswith("/") and path.startswith(named))]
    return max(matches)[1] if matches else None


def imported_files(source: Path) -> set[str]:
    """Repository paths of the numpitron modules a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        modules = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        for module in (m for m in modules if m.startswith("numpitron.")):
            path = module.replace(".", "/")
            found.add(f"{path}.py" if (REPO / f"{path}.py").exists() else f"{path}/__init__.py")
    return found


def test_every_import_in_the_package_goes_down_the_house():
    rows, wrong = house_rows(), []
    for source in sorted((REPO / "numpitron").rglob("*.py")):
        path = source.relative_to(REPO).as_posix()
        here, imports = row_of(path, rows), imported_files(source)
        if here is None:
            if imports or not path.endswith("__init__.py"):     # a package's docstring may stand alone
                wrong.append(f"{path}: in no row of the table")
            continue
        wrong += [f"{path} (row {here}) imports {target} (row {row_of(target, rows)})"
                  for target in sorted(imports) if (row_of(target, rows) or 0) < here]
    assert not wrong, "\n".join(wrong)


FIGURE = re.compile(r"([A-Za-z0-9_]+\.svg)\b")
SCRIPT = re.compile(r"benchmarks/[A-Za-z0-9_]+\.py")


def test_every_figure_a_page_names_is_drawn_by_make_figures():
    """`make figures` runs benchmarks/figures.py; a figure counts as drawn when its file
    name is written in that script or in a benchmark script it names, or they name."""
    assert "benchmarks/figures.py" in (REPO / "Makefile").read_text().split("figures:", 1)[1].split("\n\n")[0]
    scripts, todo = set(), ["benchmarks/figures.py"]
    while todo:
        script = todo.pop()
        scripts.add(script)
        todo += [s for s in SCRIPT.findall((REPO / script).read_text()) if s not in scripts and (REPO / s).exists()]
    drawn = "".join((REPO / script).read_text() for script in scripts)
    missing = sorted({f"{page.name}: {name}" for page in PAGES for name in FIGURE.findall(page.read_text())
                      if name not in drawn})
    assert not missing, "figures no script of `make figures` draws:\n" + "\n".join(missing)


@pytest.mark.parametrize("chapter", ["*-pipeline-parallelism.md", "*-putting-it-together.md"])
def test_tables_beside_figures_come_from_the_runs_that_drew_them(chapter):
    """bubble.svg and throughput.svg, and the tables beside them, come from one sweep:
    the tables `figures.py --tables` prints from figures.json stand in the chapter."""
    tables = subprocess.run([sys.executable, str(REPO / "benchmarks/figures.py"), "--tables"], check=True,
                            capture_output=True, text=True, cwd=REPO).stdout.split("\n\n")
    page = next((REPO / "docs").glob(chapter))
    table = tables[0] if "pipeline" in chapter else tables[1]
    assert table.strip() in page.read_text(), f"{page.name} lacks the table of figures.json:\n{table}"
