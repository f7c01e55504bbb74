"""numpitron against PyTorch in one session, every figure paired: the races to 1.80 and
the throughputs, for each BLAS, written to one JSON. About 15 minutes on two cores.

    python benchmarks/paired_session.py --torch-python PATH/TO/python-with-torch --out session.json

Runs, one after the other (each script alternates its own runs round by round):

1. the race (race.py --stop-at-target): numpitron on two ranks with configs/race.toml,
   with each --blas, against PyTorch on two threads with the same recipe every round and
   with nanoGPT's recipe in the first round;
2. the default model (vs_pytorch.py --pairs): one process against one thread, and dp = 2
   against two threads and against one rank, with each --blas;
3. 6 layers, d 384, T 256 (vs_pytorch.py --one-core): one process against one thread.

Each figure is a median of ratios taken within a round, with its range. The JSON says
which CPU (and its AVX-512 support), which BLAS and kernel numpitron ran (blas/products.py)
and which PyTorch ran, the load before and after, and the ratios beside the goals.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")     # before NumPy: what one rank runs on
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def cpu() -> dict:
    """The CPU's model name, its cores and whether it has AVX-512 (the kernels differ)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cores": os.cpu_count()}
    first = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    first = {k.strip(): v.strip() for k, v in first.items()}
    return {"model": first.get("model name"), "family": first.get("cpu family"), "model_number": first.get("model"),
            "cores": os.cpu_count(), "avx512f": "avx512f" in first.get("flags", "").split()}


def libraries(torch_python: str) -> dict:
    """numpitron's BLAS choices (blas/products.py) and PyTorch's build, as each reports them."""
    sys.path.insert(0, str(REPO))
    from numpitron.blas import mkl
    from numpitron.blas.products import numpy_blas
    found = {"numpy": numpy_blas()}
    library = mkl.load(1)
    found["mkl"] = library.describe() if library else None
    probe = "import torch, re; print(torch.__version__, re.findall(r'(BLAS_INFO=\\S+|CPU capability usage: \\S+)', " \
            "torch.__config__.show()))"
    found["pytorch"] = subprocess.run([torch_python, "-c", probe], capture_output=True, text=True).stdout.strip()
    return found


def run(cmd: list[str], out: Path) -> dict:
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return {"command": cmd, "seconds": round(time.perf_counter() - start, 1), **json.loads(out.read_text())}


def goals(session: dict) -> list[str]:
    """The issue's goals beside what this session measured (medians, with their range)."""
    lines = []
    for name, ratio in session["race"]["ratio_to_target"].items():
        if ratio:
            goal = " (goal: at most 0.9)" if "equal" in name else ""
            lines.append(f"race, {name}: time ratio {ratio['median']:.2f} ({ratio['min']:.2f} to {ratio['max']:.2f}, "
                         f"{ratio['rounds']} rounds){goal}")
    for part, goal in (("default", {"1 process": 1.0, "dp = 2": 1.05}), ("nanogpt", {"1 process": 1.0})):
        for row in session[part]["rows"]:
            label, ratios = row[1], row[3]
            if label.startswith("numpitron, "):
                wanted = next((g for key, g in goal.items() if key in label), None)
                lines.append(f"{row[0]}, {label}: x{statistics.median(ratios):.2f} PyTorch "
                             f"({min(ratios):.2f} to {max(ratios):.2f})" + (f" (goal: at least {wanted})" if wanted else ""))
        for split in session[part]["split"]:
            lines.append(split["text"] + (" (goal over one rank: at least 1.8)" if "over_one_rank" in split else ""))
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch-python", required=True, help="a Python with torch installed")
    p.add_argument("--out", default="session.json")
    p.add_argument("--blas", nargs="+", choices=["numpy", "mkl", "auto"], default=["numpy", "mkl"])
    p.add_argument("--race-rounds", type=int, default=2, help="rounds of the equal-recipe race")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each throughput pair")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--smoke", action="store_true", help="a minute's check of the whole chain: tiny runs, no figures")
    args = p.parse_args()
    smoke = ["--iters", "20", "--eval-interval", "10"] if args.smoke else ["--stop-at-target"]
    if args.smoke:
        args.race_rounds, args.rounds = 1, 1
    started, load = time.time(), os.getloadavg()[0]
    session = {"cpu": cpu(), "libraries": libraries(args.torch_python), "load_1min_before": round(load, 2)}
    py = str(BIN / "python")
    with tempfile.TemporaryDirectory(prefix="session-") as tmp:
        out = {name: Path(tmp) / f"{name}.json" for name in ("race", "default", "nanogpt")}
        session["race"] = run([py, "benchmarks/race.py", "--torch-python", args.torch_python, "--rounds",
                               str(args.race_rounds), "--nanogpt-rounds", "1", *smoke, "--blas", *args.blas,
                               "--data-dir", args.data_dir, "--out", str(out["race"])], out["race"])
        pairs = [py, "benchmarks/vs_pytorch.py", "--torch-python", args.torch_python, "--rounds", str(args.rounds),
                 "--max-wait", "0", "--blas", *args.blas]
        session["default"] = run(pairs + ["--pairs", "--configs", "default", "--iters", "2" if args.smoke else "30", "--out",
                                          str(out["default"])], out["default"])
        session["nanogpt"] = run(pairs + ["--one-core", "--configs", "nanogpt", "--iters", "2" if args.smoke else "12", "--out",
                                          str(out["nanogpt"])], out["nanogpt"])
    session.update(load_1min_after=round(os.getloadavg()[0], 2), minutes=round((time.time() - started) / 60, 1))
    session["against_the_goals"] = goals(session)
    Path(args.out).write_text(json.dumps(session, indent=1) + "\n")
    print("\n".join(session["against_the_goals"]))
    print(f"{session['minutes']} minutes; everything in {args.out}")


if __name__ == "__main__":
    main()
