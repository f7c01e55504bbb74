"""How close to one rank's speed times two can dp = 2 on two cores get? Appendix A's goal
asks 1.8; this splits what stands between one rank and dp = 2 into what no code of ours
decides and what is the all-reduce.

    python benchmarks/dp_ceiling.py [--rounds 5] [--iters 30]

Four runs of benchmark.py on the default model (the pair vs_pytorch.py measures), one
after the other, their order turning every round:

- one:    one process, the global batch B (12) on one core;
- half:   one process, B / 2, alone on the machine;
- halves: two processes of B / 2 at once, one a core, exchanging nothing;
- dp2:    `mpiexec -n 2`, dp = 2, B / 2 a rank, and the gradients' all-reduce.

one / half is what halving the batch leaves of the ideal 2 (each rank multiplies matrices
of half the rows); one / halves adds what two busy cores cost each other (shared cache,
memory and a shared host's vCPUs): the most dp = 2 could reach with a free all-reduce.
one / dp2 is the measured; halves / dp2 what the all-reduce and the ranks' waiting on
each other cost. Each ratio is a median over rounds of the ratio within a round (medians
of the step times), with its range. Writes --out.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from numpitron.runtime import launch_env  # noqa: E402
from vs_pytorch import CONFIGS, model_flags  # noqa: E402


def commands(batch: int, iters: int, flags: list) -> dict:
    bench = [str(BIN / "python"), "benchmarks/benchmark.py", f"--iters={iters}", *flags]
    one = [f"--global-batch-size={batch}", f"--micro-batch-size={batch}"]
    half = [f"--global-batch-size={batch // 2}", f"--micro-batch-size={batch // 2}"]
    return {"one": [bench + one], "half": [bench + half], "halves": [bench + half, bench + half],
            "dp2": [[str(BIN / "mpiexec"), "-n", "2", *bench, f"--global-batch-size={batch}",
                     f"--micro-batch-size={batch // 2}", "--data-parallel-size=2"]]}


def step_ms(cmds: list) -> float:
    """Start every command at once; the mean of their median steps (ms)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True, cwd=REPO, env=launch_env(2)) for c in cmds]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("a run failed")
    return statistics.mean(json.loads(o.strip().splitlines()[-1])["ms_per_iter_median"] for o in outs)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("dp_ceiling.json"))
    args = p.parse_args()
    cfg = CONFIGS["default"][1]
    runs = commands(cfg["batch"], args.iters, model_flags(cfg))
    names, times = list(runs), {name: [] for name in runs}
    for r in range(args.rounds):
        for name in names[r % 4:] + names[:r % 4]:
            times[name].append(step_ms(runs[name]))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.1f} ms" for n, t in times.items()), flush=True)
    ratios = {}
    for top, bottom in (("one", "half"), ("one", "halves"), ("one", "dp2"), ("halves", "dp2")):
        each = [a / b for a, b in zip(times[top], times[bottom])]
        ratios[f"{top} / {bottom}"] = {"median": statistics.median(each), "min": min(each), "max": max(each)}
        print(f"{top} / {bottom}: {statistics.median(each):.2f} ({min(each):.2f} to {max(each):.2f})")
    args.out.write_text(json.dumps({"command": sys.argv, "ms": times, "ratios": ratios}, indent=1) + "\n")


if __name__ == "__main__":
    main()
