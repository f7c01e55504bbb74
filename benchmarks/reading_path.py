"""What a learner must open to read one idea: the package files reached from a file (or a
folder) by following every `numpitron` import, at module level or inside functions, and
their lines. A package `__init__.py` under 40 lines that only names its folder is not
counted. docs/architecture.md gives the caps; tests/test_reading_path.py holds the house
to them.

    python benchmarks/reading_path.py                 # the table of the house's caps
    python benchmarks/reading_path.py numpitron/tensor_parallel/linear.py   # one file's path, file by file
"""

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FACE_LINES = 40          # a package face shorter than this costs a reader nothing

# What a learner wants to read, where it starts, and how many lines it may reach.
# The step is given its model (build.py builds both), so its row reads the two together.
CAPS = [("tensor parallelism", ("numpitron/tensor_parallel/",), 700),
        ("pipeline parallelism", ("numpitron/pipeline_parallel/",), 700),
        ("context parallelism", ("numpitron/context_parallel/",), 700),
        ("data parallelism and ZeRO", ("numpitron/data_parallel/",), 1100),
        ("the model", ("numpitron/model.py",), 2000),
        ("one training step, with its model", ("numpitron/trainer.py", "numpitron/model.py"), 3500)]


def module_path(module: str) -> Path | None:
    base = REPO / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imported(path: Path) -> set[Path]:
    """The package files one file imports, with the packages' faces that importing runs."""
    names = set()
    package = path.relative_to(REPO).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:          # relative: counted from this file's package
                base = ".".join(list(package[:len(package) - node.level]) + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    found = set()
    for name in (n for n in names if n.split(".")[0] == "numpitron"):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            target = module_path(".".join(parts[:depth]))
            if target and (depth == len(parts) or target.name == "__init__.py"):
                found.add(target)
    return found


def reading_path(*starts: Path) -> dict[Path, int]:
    """Every file reached from `starts` (files or folders), with its lines."""
    todo = [f for s in starts for f in (sorted(s.glob("*.py")) if s.is_dir() else [s])]
    seen = set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += imported(path) - seen
    lines = {p: len(p.read_text().splitlines()) for p in seen}
    return {p: n for p, n in lines.items() if not (p.name == "__init__.py" and n < FACE_LINES)}


def table() -> list[tuple[str, tuple, int, int, int]]:
    """(idea, starts, files, lines, cap) for each capped idea."""
    rows = []
    for idea, starts, cap in CAPS:
        files = reading_path(*(REPO / start for start in starts))
        rows.append((idea, starts, len(files), sum(files.values()), cap))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1:
        files = reading_path(*(Path(a).resolve() for a in sys.argv[1:]))
        print(f"{len(files)} files, {sum(files.values())} lines")
        for path, n in sorted(files.items(), key=lambda item: -item[1]):
            print(f"  {n:5d} {path.relative_to(REPO)}")
    else:
        print("| what a learner reads | starts at | files | lines | cap |\n| --- | --- | ---: | ---: | ---: |")
        for idea, starts, n_files, n_lines, cap in table():
            print(f"| {idea} | {', '.join(f'`{s}`' for s in starts)} | {n_files} | {n_lines:,} | {cap:,} |")
