"""The processes of one launched job, found through /proc: its ranks (by their MPI rank)
and the shared-memory segments they map, so that a test touches only its own job and
never another one running on the same machine."""

import os
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{MPI rank: pid} of the job started by `launcher_pid` (MPICH sets PMI_RANK)."""
    ranks = {}
    for pid in descendants(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"PMI_RANK="):
                ranks[int(entry.split(b"=", 1)[1])] = pid
    return ranks


def shared_memory_segments(launcher_pid: int) -> set[Path]:
    """The /dev/shm files the job's processes map right now, including those already
    unlinked (MPICH unlinks a segment once every rank has attached it)."""
    segments = set()
    for pid in descendants(launcher_pid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                segments.add(Path(fields[5].removesuffix(" (deleted)")))
    return segments


def watch_job(proc, every_s: float = 0.005) -> set[Path]:
    """Wait for the launched job `proc` (a Popen) to end; returns every shared-memory
    segment its processes mapped on the way."""
    seen = set()
    while proc.poll() is None:
        seen |= shared_memory_segments(proc.pid)
        time.sleep(every_s)
    return seen


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
