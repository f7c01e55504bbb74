"""metrics.jsonl: one JSON object per logged iteration, written by one rank."""

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path, enabled: bool, resume_from_iter: int | None = None):
        self.path, self.enabled = Path(path), enabled
        if enabled and resume_from_iter is not None and self.path.exists():
            # A resumed run rewrites the iterations after its checkpoint: drop them.
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("iter", 0) <= resume_from_iter]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
