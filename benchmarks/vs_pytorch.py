"""numpitron against PyTorch eager on this machine, side by side in one run.

    pip install -e ".[bench]"          # PyTorch, for this script only
    python benchmarks/vs_pytorch.py [--iters 30] [--rounds 2] [--configs default nanogpt]
    python benchmarks/vs_pytorch.py --one-core --rounds 5 --configs default
    python benchmarks/vs_pytorch.py --pairs --blas numpy mkl --rounds 3    # the pairs only, for each BLAS

PyTorch's side is nanoGPT's model and training loop (benchmarks/nanogpt_reference.py),
the code a PyTorch user knows. For each model config: PyTorch with 1 thread against
numpitron on one process (one BLAS thread) (`--one-core` stops here), then PyTorch with 2 threads against numpitron on 2 ranks (dp = 2, plain
and with ZeRO-2, and tp = 2, same global batch); and the ceilings of numpitron's step
on these BLAS calls, its matmuls alone and its matmuls with the exponentials of exact
GELU and softmax (benchmarks/matmul_ceiling.py), on one core and twice that for two.
Every run is its own process, so peak memory is its own; runs alternate for `--rounds`
rounds. The machine's speed drifts by a fifth within minutes, so a ratio is taken
within each round (numpitron's run over PyTorch's run with the same threads, seconds
apart) and the table gives the median of those ratios and their range, beside the
median tokens/s. Prints a Markdown table and one JSON object per run.

Each engine's MFU is taken against its own BLAS's measured sgemm ceiling per core
(numpitron's: the library --blas chose, timed by benchmark.py; PyTorch's: torch.mm on one
thread, timed by nanogpt_reference.py), so a ratio of throughputs splits into two factors,

    tokens/s ratio = (numpitron's ceiling / PyTorch's ceiling) x (numpitron's MFU / PyTorch's MFU)
                   =            the BLAS                       x          the rest of the step

and the table's last lines say, per config, which of the two a gap comes from.
"""

import argparse
import json
import os
import statistics
import subprocess
import time
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))
from numpitron.runtime import launch_env  # noqa: E402
CONFIGS = {   # short name -> (name in the table, model and batch)
    "default": ("default (L4 C128 T64 B12)", dict(n_layers=4, n_heads=4, d_model=128, seq_len=64, batch=12)),
    "nanogpt": ("nanoGPT char (L6 C384 T256 B8)", dict(n_layers=6, n_heads=6, d_model=384, seq_len=256, batch=8)),
}


def model_flags(cfg: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items() if k != "batch"]


def busy_share(seconds: float = 2.0) -> float:
    """The share of the machine's CPU time others used over a few seconds (run between our runs)."""
    def ticks():
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        return sum(fields) - fields[3] - fields[4], sum(fields)   # busy, total (idle and iowait aside)
    (b1, t1), _ = ticks(), time.sleep(seconds)
    b2, t2 = ticks()
    return (b2 - b1) / max(1, t2 - t1)


def quiet_moment(max_wait: float) -> float:
    """Wait (up to max_wait s) until at least one core is free; return the busy share seen last."""
    deadline = time.monotonic() + max_wait
    while (busy := busy_share()) > 0.5 and time.monotonic() < deadline:
        pass
    return busy


def run_json(cmd: list[str]) -> dict:
    # two ranks on two cores, as a user's `mpiexec -n 2` runs them: no yield inherited from the shell
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, env=launch_env(2)).stdout
    return json.loads(out.strip().splitlines()[-1])


def runs(cfg: dict, iters: int, torch_python: str, one_core: bool, blas=("numpy",), pairs=False,
         optimizer="adamw") -> dict:
    """label -> command printing one JSON object with tokens_per_s and peak_rss_mb: PyTorch's
    runs, then numpitron's for each BLAS (labels ending ", blas NAME" when there are several).
    pairs: only the runs a ratio pairs (1 thread and 1 process; 2 threads and dp = 2, plain and ZeRO-1)."""
    torch = [torch_python, "benchmarks/nanogpt_reference.py", f"--batch={cfg['batch']}",
             f"--iters={iters}", f"--optimizer={optimizer}", *model_flags(cfg)]
    found = {"pytorch, 1 thread": torch + ["--threads=1"]}
    if not one_core:
        found["pytorch, 2 threads"] = torch + ["--threads=2"]
        if not pairs:
            found["numpitron's matmuls alone, 1 core"] = [str(BIN / "python"), "benchmarks/matmul_ceiling.py",
                                                          f"--batch={cfg['batch']}", *model_flags(cfg)]
    for name in blas:
        ours = [str(BIN / "python"), "benchmarks/benchmark.py", f"--global-batch-size={cfg['batch']}",
                f"--iters={iters}", f"--blas={name}", f"--optimizer={optimizer}", *model_flags(cfg)]
        two = [str(BIN / "mpiexec"), "-n", "2"] + ours
        dp2 = two + ["--data-parallel-size=2", f"--micro-batch-size={cfg['batch'] // 2}"]
        tail = f", blas {name}" if len(blas) > 1 else ""
        found["numpitron, 1 process" + tail] = ours + [f"--micro-batch-size={cfg['batch']}"]
        if one_core:
            continue
        found["numpitron, dp = 2" + tail] = dp2
        # ZeRO-1: each rank runs AdamW on half the parameters, the one part of a step that
        # plain dp repeats on every rank (docs/08-zero.md); the same bytes as the all-reduce.
        found["numpitron, dp = 2, ZeRO-1" + tail] = dp2 + ["--zero-stage=1"]
        if not pairs:
            # ZeRO-2: the gradients' reduce-scatter moves half an all-reduce's bytes in the
            # backward (docs/09-zero-2-and-3.md).
            found["numpitron, dp = 2, ZeRO-2" + tail] = dp2 + ["--zero-stage=2"]
            found["numpitron, tp = 2" + tail] = two + ["--tensor-parallel-size=2", f"--micro-batch-size={cfg['batch']}"]
    return found


def threads(result: dict) -> int:
    """Cores a run used: PyTorch's threads and the ceiling's say so; numpitron's mesh, its ranks."""
    return result["threads"] if "threads" in result else result["mesh"]["world"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--torch-python", default=str(BIN / "python"), help="a Python that has torch")
    p.add_argument("--one-core", action="store_true", help="only the one-thread pair, no ceilings")
    p.add_argument("--pairs", action="store_true", help="only the paired runs: 1 thread / 1 process, 2 threads / dp = 2")
    p.add_argument("--blas", nargs="+", choices=["numpy", "mkl", "auto"], default=["numpy"],
                   help="numpitron's --blas, one run of each per round")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="both engines' optimizer")
    p.add_argument("--out", help="also write every run's JSON and the table's rows here")
    p.add_argument("--max-wait", type=float, default=60,
                   help="seconds to wait before each round for others' jobs to leave a core free")
    args = p.parse_args()
    rows, every, splits = [], [], []
    for name, cfg in (CONFIGS[key] for key in args.configs):
        results = {}
        for _ in range(args.rounds):
            busy = quiet_moment(args.max_wait)      # each round starts, if it can, with a core free
            for label, cmd in runs(cfg, args.iters, args.torch_python, args.one_core, args.blas, args.pairs,
                                   args.optimizer).items():
                result = run_json(cmd)
                # the machine is shared: each run carries the load it started under
                print(json.dumps({"config": name, "run": label, "others_busy_before_round": round(busy, 2),
                                  "load_1min": os.getloadavg()[0], **result}), flush=True)
                results.setdefault(label, []).append(result)
                every.append({"config": name, "run": label, "others_busy_before_round": round(busy, 2), **result})
        # Each engine's MFU against its own BLAS's sgemm ceiling per core: numpitron's
        # runs measured theirs (benchmark.py, `mfu`); PyTorch's, torch.mm on one thread.
        ours = [r for label, rs in results.items() if label.startswith("numpitron") for r in rs]
        flops_per_token = ours[0]["flops_per_token"]
        base = {threads(rs[0]): rs for label, rs in results.items() if label.startswith("pytorch")}
        for label, rs in results.items():
            tokens_per_s = statistics.median(r["tokens_per_s"] for r in rs)
            if "mfu" in rs[0]:
                mfu = statistics.median(r["mfu"] for r in rs)
                ceiling = statistics.median(r.get("peak_gflops_per_rank", 0) for r in rs) or None
            else:
                ceiling = statistics.median(r["sgemm_gflops_1thread"] for r in rs)
                mfu = tokens_per_s * flops_per_token / (ceiling * 1e9 * rs[0]["threads"])
            # each round's ratio against PyTorch's run of the same round and threads
            ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base[threads(rs[0])])]
            rows.append((name, label, tokens_per_s, ratios, max(r["peak_rss_mb"] for r in rs), mfu, ceiling))
        splits += blas_and_rest(name, results, rows)
        # Two cores can at best double one core's rate: the ceilings of any 2-rank layout,
        # the matmuls alone and the matmuls with the exponentials nothing can skip (the
        # first one's one-core row is already in, as a run of its own).
        alone = results.get("numpitron's matmuls alone, 1 core", [])
        ceilings = (("matmuls alone", "tokens_per_s", "mfu", (2,)),
                    ("matmuls and exps alone", "tokens_per_s_with_exps", "mfu_with_exps", (1, 2))) if alone else ()
        for what, rate, mfu, cores_rows in ceilings:
            for cores in cores_rows:
                ratios = [cores * r[rate] / b["tokens_per_s"] for r, b in zip(alone, base[cores])]
                label = f"numpitron's {what}, " + ("1 core" if cores == 1 else f"{cores} cores (twice 1)")
                rows.append((name, label, cores * statistics.median(r[rate] for r in alone), ratios,
                             max(r["peak_rss_mb"] for r in alone), statistics.median(r[mfu] for r in alone), None))
    if args.one_core:
        # on a loaded machine a run's fastest step is the one least disturbed by others' jobs
        for label in (label for label in results if label.startswith("numpitron, 1 process")):
            best = [b["ms_per_iter_min"] / r["ms_per_iter_min"]
                    for b, r in zip(results["pytorch, 1 thread"], results[label])]
            print(f"\nfastest step, {label} over PyTorch: median {statistics.median(best):.2f} "
                  f"(rounds {min(best):.2f} to {max(best):.2f})")
    print("\n| config | run | tokens/s | x PyTorch (same threads) | range over rounds | MFU (own sgemm ceiling) "
          "| ceiling GFLOP/s a core | peak RSS MB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, label, tps, ratios, rss, mfu, ceiling in rows:
        spread = f"{min(ratios):.2f} to {max(ratios):.2f}"
        print(f"| {name} | {label} | {tps:,.0f} | {statistics.median(ratios):.2f} | {spread} | {mfu:.2f} | "
              f"{ceiling or float('nan'):.0f} | {rss:.0f} |")
    for line in splits:
        print(line["text"])
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": every, "rows": rows, "split": splits}, indent=1) + "\n")


def blas_and_rest(name: str, results: dict, rows: list) -> list[dict]:
    """Per numpitron run paired with PyTorch's: its tokens/s ratio as the ratio of the two
    BLAS ceilings times the ratio of the two MFUs (the module's docstring), from the
    medians in `rows`; and dp = 2 over one rank of the same BLAS, round by round."""
    mine = {label: row for row in rows if row[0] == name for label in [row[1]]}
    out = []
    for label, (_, _, tps, ratios, _, mfu, ceiling) in mine.items():
        torch_label = "pytorch, 1 thread" if "1 process" in label else "pytorch, 2 threads"
        if not label.startswith("numpitron, ") or torch_label not in mine or "tp = 2" in label:
            continue
        _, _, _, _, _, torch_mfu, torch_ceiling = mine[torch_label]
        blas, rest = ceiling / torch_ceiling, mfu / torch_mfu
        entry = {"config": name, "run": label, "ratio_median": round(statistics.median(ratios), 3),
                 "blas_ceiling_ratio": round(blas, 3), "mfu_ratio": round(rest, 3)}
        if label.startswith("numpitron, dp = 2"):
            one = results.get("numpitron, 1 process" + label[label.find(", blas"):] if ", blas" in label
                              else "numpitron, 1 process", [])
            scaling = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(results[label], one)]
            if scaling:
                entry["over_one_rank"] = {"median": round(statistics.median(scaling), 3),
                                          "min": round(min(scaling), 3), "max": round(max(scaling), 3)}
        entry["text"] = (f"{name}, {label}: x{entry['ratio_median']:.2f} PyTorch = BLAS ceilings x{blas:.2f} "
                         f"x MFUs x{rest:.2f}" + (f"; over one rank x{entry['over_one_rank']['median']:.2f} "
                                                  f"({entry['over_one_rank']['min']:.2f} to "
                                                  f"{entry['over_one_rank']['max']:.2f})"
                                                  if "over_one_rank" in entry else ""))
        out.append(entry)
    return out


if __name__ == "__main__":
    main()
