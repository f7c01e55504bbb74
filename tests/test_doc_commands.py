"""The book's commands stay true: every command in a ```bash block of docs/ and the
README runs, at a tiny scale, in the order the page gives it. Blocks marked ```text are
illustrative (installs, downloads, long runs) and are not run; a ```bash block may only
hold commands this test knows how to shrink.

Shrinking: training gets a tiny model and two iterations (later flags win in argparse, so
they override the page's), a temporary --data-dir with the text and a temporary
--out-dir (--overwrite unless the command resumes); sampling gets five new tokens from that
--out-dir; the one-process GPT the same tiny model; the planner and the trace's summary run
as they are, a bare FILE.json beside --out-dir.
"""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, shakespeare_text_path

PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
TINY = ["--n-layers", "4", "--n-heads", "2", "--d-model", "32", "--seq-len", "16", "--eval-interval", "2",
        "--eval-iters", "1", "--log-interval", "1", "--no-progress"]


def commands(page: Path) -> list[str]:
    found = []
    for block in BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                found.append(line)
    return found


def shrink(command: str, data: Path, out: Path) -> list[str]:
    words = shlex.split(command)
    launcher = words[:3] if words[0] == "mpiexec" else []
    rest = words[len(launcher):]
    bin_dir = Path(sys.executable).parent
    if launcher:
        launcher = [str(bin_dir / "mpiexec")] + launcher[1:]
    assert rest[0] == "python", f"not a command this test can run (mark the block ```text): {command}"
    # A file a command writes or reads by a bare name (a trace) lives beside --out-dir.
    args = [str(out.parent / arg) if arg.endswith(".json") and "/" not in arg else arg for arg in rest[1:]]
    if args[:2] in (["-m", "numpitron.plan"], ["-m", "numpitron.trace"]):
        return launcher + [sys.executable, *args]
    if args[:2] == ["-m", "numpitron.reference"]:            # the one-process GPT: the same tiny model
        return [sys.executable, *args, *TINY[:10], "--eval-iters", "1", "--max-iters", "2", "--data-dir", str(data)]
    script, args = args[0], args[1:]
    if script == "train_shakespeare.py":
        iters = "3" if "--resume" in args else "2"
        extra = [] if "--resume" in args else ["--overwrite"]
        return launcher + [sys.executable, str(REPO / script), *args, *TINY, "--max-iters", iters,
                           "--data-dir", str(data), "--out-dir", str(out), *extra]
    if script == "sample.py":
        return launcher + [sys.executable, str(REPO / script), *args, "--max-new-tokens", "5", "--out-dir", str(out)]
    raise AssertionError(f"not a command this test can run (mark the block ```text): {command}")


@pytest.mark.parametrize("page", [p for p in PAGES if commands(p)], ids=lambda p: p.name)
def test_every_shell_command_runs(page, tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    shutil.copy(shakespeare_text_path(), data / "tinyshakespeare.txt")
    for command in commands(page):
        result = subprocess.run(shrink(command, data, out), capture_output=True, text=True, cwd=REPO, timeout=180)
        assert result.returncode == 0, f"{page.name}: {command}\n{result.stderr[-2000:]}"
