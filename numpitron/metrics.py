"""metrics.jsonl: one JSON object per logged iteration, written by one rank.

Rows are appended and flushed one at a time, so a killed run loses at most the row
being written. A resumed run keeps the rows up to its checkpoint and drops the rest
(they will be recomputed); that rewrite goes to a temporary file renamed over the old
one, so a kill during it leaves the old file whole. A partial last line (a kill in
the middle of a write) is dropped with a note.
"""

import json
import os
from pathlib import Path

from numpitron.errors import UserError


def read_rows(path: Path) -> tuple[list[dict], int]:
    """(rows that parse, number of lines that did not)."""
    rows, broken = [], 0
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            broken += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            broken += 1
    return rows, broken


class MetricsLog:
    def __init__(self, path: Path, enabled: bool, resume_from_iter: int | None = None, first: dict | None = None):
        """first: what the first row written also says (the BLAS that ran, blas/products.py)."""
        self.path, self.enabled, self.first = Path(path), enabled, first or {}
        if not enabled:
            return
        try:
            if resume_from_iter is not None and self.path.exists():
                rows, broken = read_rows(self.path)
                if broken:
                    print(f"{self.path}: dropped {broken} unreadable line(s), e.g. a row cut short by a kill",
                          flush=True)
                kept = [r for r in rows if isinstance(r.get("iter"), int) and r["iter"] <= resume_from_iter]
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                os.replace(tmp, self.path)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.write_text("")
        except OSError as error:
            raise UserError(f"cannot write metrics to {self.path}: {error.strerror or error}") from None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record, self.first = {**record, **self.first}, {}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as error:
            raise UserError(f"cannot write metrics to {self.path}: {error.strerror or error}") from None
