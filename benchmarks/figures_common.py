"""What every figure script shares: where the repository and the figures are, how a run
is launched and its JSON read, and the caption that names the command and the machine."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FIGURES = REPO / "docs" / "figures"
LAYOUTS = [("one process", 1, []), ("dp = 2", 2, ["--data-parallel-size", "2"]),
           ("tp = 2", 2, ["--tensor-parallel-size", "2"]),
           ("pp = 2", 2, ["--pipeline-parallel-size", "2"]),
           ("cp = 2", 2, ["--context-parallel-size", "2"]),
           ("dp = 2, ZeRO-1", 2, ["--data-parallel-size", "2", "--zero-stage", "1"]),
           ("tp = 2, sp", 2, ["--tensor-parallel-size", "2", "--sequence-parallel"])]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores"


def launch(ranks: int, script: str, args: list) -> list:
    prefix = [str(BIN / "mpiexec"), "-n", str(ranks)] if ranks > 1 else []
    return prefix + [str(BIN / "python"), script, *args]


def run_json(cmd: list) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])


def caption(ax, text: str, where: str | None = None) -> None:
    """The command and the machine, under the x-axis label (anchored to it, so it never
    overlaps the tick labels however tall they are; bbox_inches="tight" keeps it in)."""
    ax.annotate(f"{text}\n{where or machine()}", xy=(0, 0), xycoords=("axes fraction", ax.xaxis.label),
                xytext=(0, -6), textcoords="offset points", fontsize=6, color="#555555", va="top", ha="left")
