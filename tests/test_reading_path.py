"""The house's reading path (docs/architecture.md, "The house"): each strategy folder, the
model and one training step read within their caps, no file is long, and no import
circles back."""

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("reading_path", REPO / "benchmarks/reading_path.py")
reading_path = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reading_path)


@pytest.mark.parametrize("idea, starts, files, lines, cap", reading_path.table(), ids=[c[0] for c in reading_path.CAPS])
def test_each_idea_reads_within_its_cap(idea, starts, files, lines, cap):
    assert lines <= cap, f"{idea} reaches {lines} lines in {files} files (cap {cap}): " \
                         f"python benchmarks/reading_path.py {' '.join(starts)}"


def test_the_rule_follows_imports_inside_functions_and_package_faces(tmp_path):
    """The rule counts an import wherever it stands: a core file that imports a tool
    inside a function reaches the tool."""
    reached = reading_path.reading_path(REPO / "numpitron/train.py")
    assert REPO / "numpitron/build.py" in reached and REPO / "numpitron/model.py" in reached
    assert REPO / "numpitron/cluster/network.py" not in reading_path.reading_path(REPO / "numpitron/model.py")


def test_no_file_is_long():
    """One idea a file: at most 300 lines, the one-process GPT (read first, whole) 800."""
    long = {str(p.relative_to(REPO)): n for p in (REPO / "numpitron").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > (800 if p.name == "reference.py" else 300)}
    assert not long, long


def explicit_imports(path: Path) -> set[Path]:
    """The package files a file names in its imports (a package's face only where it
    imports from the face itself): the edges a circle would run along."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{alias.name}" if reading_path.module_path(f"{node.module}.{alias.name}")
                     else node.module for alias in node.names]
        else:
            continue
        found |= {reading_path.module_path(n) for n in names if n.startswith("numpitron")} - {None}
    return found


def test_no_import_circles_back():
    files = sorted((REPO / "numpitron").rglob("*.py"))
    graph = {f: explicit_imports(f) - {f} for f in files}
    state, circles = {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(str(p.relative_to(REPO)) for p in trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for f in files:
        if f not in state:
            visit(f, [f])
    assert not circles, circles
