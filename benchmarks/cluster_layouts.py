"""Every 4-rank layout on a simulated cluster scaled to an A100 cluster, measured
beside the planner's prediction (docs/17-many-hosts.md). Needs root.

    python benchmarks/cluster_layouts.py                      # the default model
    python benchmarks/cluster_layouts.py --model nanogpt      # 6 layers, 6 heads, d 384, T 256

The scale: this CPU's sgemm rate (the this-machine profile's peak) over the A100's
312 TFLOP/s. Each link gets the A100 link's bandwidth times that ratio, so a byte
costs the same number of FLOPs here as there: NVLink's 300 GB/s each way per GPU for
the intra-host tier, InfiniBand's 25 GB/s per GPU for the inter-host tier (a host's
link carries R GPUs' worth). Every rank has its own namespace and shaped link (the
cluster's --intra-host-rate mode), so both tiers are links.

For each placement (--hosts-of: ranks per host, hosts filled in order) it brings up a
cluster, measures each layout with benchmarks/benchmark.py through `cluster run`, and
plans it with the same profile, each tier's per-message latency alpha fitted to a sweep
of all-reduces from 8 bytes to 256 KiB (devices.fit_link).
Prints a Markdown table. One round by default: the machine is shared, so differences
under ~15% between layouts are within its noise.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from numpitron.errors import UserError  # noqa: E402
from numpitron.plan.devices import PAPER, fit_link, load_device  # noqa: E402
from cluster_prediction import PAIR_ELEMENTS, plan_step, predict  # noqa: E402

A100 = PAPER["a100-80gb-node"]
PREFIX = "npt-bench-"
MESHES = [(4, 1, 1, 1), (1, 4, 1, 1), (1, 1, 4, 1), (1, 1, 1, 4), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2),
          (1, 2, 2, 1), (1, 2, 1, 2), (1, 1, 2, 2)]             # (tp, pp, dp, cp)
MODELS = {"default": [], "nanogpt": ["--n-layers", "6", "--n-heads", "6", "--d-model", "384", "--seq-len", "256"]}
BATCH = ["--micro-batch-size", "3", "--global-batch-size", "12"]       # hsdp.py's


def cluster(*args, prefix=None, check=True) -> str:
    """`python -m numpitron.cluster ARGS` on the cluster named by `prefix` (default PREFIX,
    which --prefix sets: each person measuring at once uses their own)."""
    env = {**os.environ, "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "numpitron.cluster", "--prefix", prefix or PREFIX, *args],
                          capture_output=True, text=True, cwd=REPO, env=env)
    if check and done.returncode:
        raise SystemExit(f"cluster {' '.join(args[:3])} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout


def mesh_flags(mesh) -> list[str]:
    tp, pp, dp, cp = mesh
    return ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--data-parallel-size", str(dp), "--context-parallel-size", str(cp)]


def scaled_rates(peak: float) -> tuple[float, float]:
    """(intra, inter) bytes/s per rank: the A100's links times this CPU's FLOP/s over the A100's."""
    ratio = peak / A100.peak_flops
    return A100.intra_bandwidth * ratio, A100.inter_bandwidth * ratio


def scaled_cluster(hosts: int, per_host: int, inter: float, intra: float, prefix: str | None = None,
                   mtu: int | None = None) -> None:
    """Bring up (again) a cluster whose every rank has its own link of `intra` bytes/s and
    whose host links carry `per_host` ranks' worth of `inter` bytes/s each (frames of
    `mtu` bytes, or the cluster's default)."""
    cluster("down", prefix=prefix, check=False)
    cluster("up", "--hosts", str(hosts), "--ranks-per-host", str(per_host), "--inter-host-rate",
            f"{8 * inter * per_host / 1e3:.0f}kbit", "--intra-host-rate", f"{8 * intra / 1e3:.0f}kbit",
            *(["--mtu", str(mtu)] if mtu else []), prefix=prefix)


SWEEP = [8 << s for s in range(0, 16, 3)] + [1 << 20]     # 8 B .. 1 MiB: the latency's end to the bandwidth's


def probe():
    """Median seconds of all-reduces of each size in SWEEP between two ranks."""
    import numpy as np
    from mpi4py import MPI
    world, out = MPI.COMM_WORLD, {}
    for size in SWEEP:
        x, times = np.ones(size // 8), []
        for _ in range(5):
            world.Allreduce(MPI.IN_PLACE, x)
        for _ in range(40 if size < 1 << 15 else 10):
            world.Barrier()
            start = time.perf_counter()
            world.Allreduce(MPI.IN_PLACE, x)
            times.append(time.perf_counter() - start)
        out[size] = world.allreduce(statistics.median(times), op=MPI.MAX)
    if world.Get_rank() == 0:
        print(json.dumps(out))


def link_fit(per_host: int, prefix: str | None = None) -> tuple[float, float]:
    """(alpha, beta) of the tier two ranks `per_host` to a host reach each other over
    (1: the inter-host links, 2: the intra-host ones), fitted to the sweep
    (devices.fit_link): the per-message cost the planner charges is this alpha."""
    out = cluster("run", "-n", "2", "--per-host", str(per_host), "--", sys.executable, __file__, "--probe",
                  prefix=prefix)
    seconds = json.loads(out.strip().splitlines()[-1])
    return fit_link([int(size) for size in seconds], list(seconds.values()))


def pair_all_reduce_added(prefix: str | None = None) -> float:
    """Seconds an 8-byte all-reduce between matmuls adds to each rank's loop when the
    cluster's 4 ranks share the 2 cores in pairs (benchmarks/calibrate.py's
    --time-sharing, run on the cluster: with 2 ranks a host the pairs are inside hosts,
    with 1 across them). A message this small costs its link only alpha, so what is
    left is the wait for the peer to be scheduled (sync_wait)."""
    out = cluster("run", "-n", "4", "--", sys.executable, "benchmarks/calibrate.py", "--time-sharing",
                  "--pair-elements", str(PAIR_ELEMENTS), prefix=prefix)
    return float(out.strip().splitlines()[-1])


def latency(per_host: int, prefix: str | None = None) -> float:
    return link_fit(per_host, prefix)[0]


def measure_run(flags: list, iters: int, warmup: int = 2, prefix: str | None = None) -> dict:
    """benchmarks/benchmark.py's JSON for these flags on the cluster's 4 ranks."""
    out = cluster("run", "-n", "4", "--", sys.executable, "benchmarks/benchmark.py", "--warmup", str(warmup),
                  "--iters", str(iters), *flags, prefix=prefix)
    return json.loads(out.strip().splitlines()[-1])


def measure(flags: list, iters: int, prefix: str | None = None) -> float:
    return measure_run(flags, iters, prefix=prefix)["ms_per_iter_median"]


def replan(path: Path) -> None:
    """Plan every row of a saved run again with the planner as it is now, and print the summary."""
    data, cpu = json.loads(path.read_text()), load_device("this-machine")
    for row in data["rows"]:
        predict(row, cpu)
    path.write_text(json.dumps(data, indent=1) + "\n")
    for model in sorted({r["model"] for r in data["rows"]}):
        print(f"{model}:")
        rows = [r for r in data["rows"] if r["model"] == model]
        table(rows)
        summary(rows)


def table(rows: list) -> None:
    """Every row as a Markdown table (benchmarks/README.md keeps it), by placement and rate."""
    print("| ranks per host | inter-host Mbit/s | tp pp dp cp | crosses hosts | measured ms | predicted ms "
          "| predicted / measured | A100 predicted ms |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for r in sorted(rows, key=lambda r: (-r["per_host"], r["inter_multiple"], MESHES.index(tuple(r["mesh"])))):
        print(f"| {r['per_host']} | {r['inter_mbit_s']:.1f} | {' '.join(map(str, r['mesh']))} | "
              f"{', '.join(r['crosses']) or '-'} | {r['measured_ms']:,.0f} | {r['predicted_ms']:,.0f} | "
              f"{r['predicted_ms'] / r['measured_ms']:.2f} | {r['a100_ms']:.2f} |")


def spearman(a: list, b: list) -> float:
    """Rank correlation of two lists of distinct values."""
    rank_a, rank_b = [sorted(a).index(x) for x in a], [sorted(b).index(x) for x in b]
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(rank_a, rank_b)) / (n * (n * n - 1))


def summary(rows: list) -> None:
    """Within 20%, and the rankings (fastest first) and their rank correlation per placement and rate."""
    ratios = [r["predicted_ms"] / r["measured_ms"] for r in rows]
    print(f"\npredicted / measured: median {statistics.median(ratios):.2f}, "
          f"{sum(abs(r - 1) <= 0.2 for r in ratios)} of {len(ratios)} within 20%")
    for key in sorted({(r["per_host"], r["inter_multiple"]) for r in rows}, reverse=True):
        group = [r for r in rows if (r["per_host"], r["inter_multiple"]) == key]
        if len(group) < 3:
            continue
        columns = [[r[c] for r in group] for c in ("measured_ms", "predicted_ms", "a100_ms")]
        names = [" ".join("".join(map(str, r["mesh"])) for _, r in sorted(zip(col, group), key=lambda t: t[0]))
                 for col in columns]
        print(f"{key[0]} ranks per host at {key[1]:g}x, fastest first (tp pp dp cp): measured {names[0]}; "
              f"planned {names[1]}; planned on A100s {names[2]}; rank correlation with measured: planned "
              f"{spearman(columns[0], columns[1]):.2f}, on A100s {spearman(columns[0], columns[2]):.2f}")


def save(path: Path, model: str, rows: list, fits: dict) -> None:
    """Merge these rows into the JSON at `path` (a row replaces one of the same model,
    placement, rate and mesh), for docs/17-many-hosts.md's tables and figures.py's figure."""
    data = json.loads(path.read_text()) if path.exists() else {"rows": [], "fits": {}}
    key = ("model", "per_host", "inter_multiple", "mesh")
    new = {tuple(str(r[k]) for k in key) for r in rows}
    data["rows"] = [r for r in data["rows"] if tuple(str(r[k]) for k in key) not in new] + rows
    data["fits"].update({f"{model} {k}": v for k, v in fits.items()})
    path.write_text(json.dumps(data, indent=1) + "\n")


def main():
    global PREFIX
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="default")
    p.add_argument("--hosts-of", default="2,1", help="ranks per host of each placement, e.g. 2,1")
    p.add_argument("--rates", default="1", help="inter-host rates, as multiples of the scaled InfiniBand: 0.25,1,4")
    p.add_argument("--meshes", default=None, help="only these layouts (tp pp dp cp), e.g. 2121,1221")
    p.add_argument("--batch", default="3,12", help="micro-batch and global batch")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="merge the rows into this JSON (docs/figures/cluster_layouts.json)")
    p.add_argument("--prefix", default=PREFIX, help="the cluster's names start with this (default npt-bench-)")
    p.add_argument("--mtu", type=int, default=None, help="frame size of the cluster's links (default: its own)")
    p.add_argument("--replan", action="store_true", help="plan the rows of --out again, without measuring")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        return probe()
    if args.replan:
        return replan(Path(args.out))
    PREFIX = args.prefix
    cpu = load_device("this-machine")
    intra, infiniband = scaled_rates(cpu.peak_flops)
    micro, batch = args.batch.split(",")
    meshes = [m for m in MESHES if args.meshes is None or "".join(map(str, m)) in args.meshes.split(",")]
    print(f"scale: {cpu.peak_flops / 1e9:.0f} GFLOP/s here over the A100's {A100.peak_flops / 1e12:.0f} TFLOP/s; "
          f"intra-host {8 * intra / 1e6:.0f} Mbit/s and inter-host {8 * infiniband / 1e6:.1f} Mbit/s per rank")
    print("| ranks per host | inter-host Mbit/s | tp pp dp cp | crosses hosts | measured ms | predicted ms "
          "| predicted / measured | A100 predicted ms | speed | load |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows, fits = [], {}
    for per_host in (int(r) for r in args.hosts_of.split(",")):
        for multiple in (float(m) for m in args.rates.split(",")):
            rows += placement(args, cpu, per_host, multiple, intra, infiniband * multiple, meshes,
                              ["--micro-batch-size", micro, "--global-batch-size", batch], fits)
    cluster("down", check=False)
    summary(rows)
    if args.out:
        save(Path(args.out), args.model, rows, fits)


def placement(args, cpu, per_host, multiple, intra, inter, meshes, batch, fits) -> list:
    """Bring a cluster up with hosts of per_host ranks at this inter-host rate, fit its
    tiers, and measure and plan each mesh on it."""
    hosts, rows = 4 // per_host, []
    scaled_cluster(hosts, per_host, inter, intra, mtu=args.mtu)
    alpha_inter, beta_inter = link_fit(1) if hosts > 1 else (0.0, inter)
    alpha_intra, beta_intra = link_fit(2) if per_host > 1 else (0.0, intra)
    fits[f"{per_host} per host at {multiple:g}x"] = {"alpha_inter_s": alpha_inter, "beta_inter_bytes_s": beta_inter,
                                                     "alpha_intra_s": alpha_intra, "beta_intra_bytes_s": beta_intra,
                                                     "pair_all_reduce_added_s": pair_all_reduce_added()}
    print(f"fitted on {hosts} hosts of {per_host}: inter-host alpha {1e6 * alpha_inter:.0f} us, "
          f"beta {8 * beta_inter / 1e6:.1f} Mbit/s (shaped {8 * inter / 1e6:.1f}); intra-host alpha "
          f"{1e6 * alpha_intra:.0f} us, beta {8 * beta_intra / 1e6:.1f} Mbit/s (shaped {8 * intra / 1e6:.0f}); "
          f"a pair's 8-byte all-reduce adds {1e3 * fits[f'{per_host} per host at {multiple:g}x']['pair_all_reduce_added_s']:.2f} ms "
          f"between matmuls", flush=True)
    tiers = fits[f"{per_host} per host at {multiple:g}x"]
    a100 = replace(A100, ranks_per_host=per_host, inter_bandwidth=A100.inter_bandwidth * multiple)
    for mesh in meshes:
        flags = MODELS[args.model] + batch + mesh_flags(mesh)
        try:
            on_a100 = plan_step(flags, a100)
        except UserError as error:
            print(f"| {per_host} | | {' '.join(map(str, mesh))} | rejected: {error} | | | | | | |")
            continue
        run = measure_run(flags, args.iters, args.warmup)
        row = {"model": args.model, "per_host": per_host, "inter_multiple": multiple, "mesh": list(mesh),
               "flags": flags, "inter_mbit_s": 8 * inter / 1e6, "intra_mbit_s": 8 * intra / 1e6, **tiers,
               "measured_ms": run["ms_per_iter_median"], "a100_ms": 1e3 * on_a100["step_s"],
               "sgemm_gflops_per_rank": run["peak_gflops_per_rank"], "load": run["loadavg_1min_at_start"],
               "iters": args.iters}
        planned = predict(row, cpu)
        rows.append(row)
        measured, speed = row["measured_ms"], row["speed"]
        print(f"| {per_host} | {8 * inter / 1e6:.1f} | {' '.join(map(str, mesh))} | "
              f"{', '.join(planned['groups_across_hosts']) or '-'} | {measured:.0f} | {1e3 * planned['step_s']:.0f} "
              f"| {1e3 * planned['step_s'] / measured:.2f} | {1e3 * on_a100['step_s']:.3f} | {speed:.2f} "
              f"| {run['loadavg_1min_at_start']:.1f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
