"""Every 4-rank layout on a simulated cluster scaled to an A100 cluster, measured
beside the planner's prediction (docs/15-many-hosts.md). Needs root.

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
plans it with the same profile, the links' latency measured by an 8-byte all-reduce.
Prints a Markdown table. One round by default: the machine is shared, so differences
under ~15% between layouts are within its noise.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from numpitron.errors import UserError  # noqa: E402
from numpitron.plan.devices import PAPER, load_device  # noqa: E402

A100 = PAPER["a100-80gb-node"]
PREFIX = "npt-bench-"
MESHES = [(4, 1, 1, 1), (1, 4, 1, 1), (1, 1, 4, 1), (1, 1, 1, 4), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2),
          (1, 2, 2, 1), (1, 2, 1, 2), (1, 1, 2, 2)]             # (tp, pp, dp, cp)
MODELS = {"default": [], "nanogpt": ["--n-layers", "6", "--n-heads", "6", "--d-model", "384", "--seq-len", "256"]}
BATCH = ["--micro-batch-size", "3", "--global-batch-size", "12"]


def cluster(*args, check=True) -> str:
    done = subprocess.run([sys.executable, "-m", "numpitron.cluster", "--prefix", PREFIX, *args],
                          capture_output=True, text=True, cwd=REPO)
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


def probe():
    """Seconds of one 8-byte all-reduce between two ranks (2 alpha for n = 2)."""
    import numpy as np
    from mpi4py import MPI
    world, x = MPI.COMM_WORLD, np.ones(1)
    for _ in range(20):
        world.Allreduce(MPI.IN_PLACE, x)
    start = time.perf_counter()
    for _ in range(200):
        world.Allreduce(MPI.IN_PLACE, x)
    if world.Get_rank() == 0:
        print(json.dumps({"allreduce_s": (time.perf_counter() - start) / 200}))


def latency(per_host: int) -> float:
    out = cluster("run", "-n", "2", "--per-host", str(per_host), "--", sys.executable, __file__, "--probe")
    return json.loads(out.strip().splitlines()[-1])["allreduce_s"] / 2


def plan_step(flags: list, device) -> dict:
    """The planner's result for these training flags on 4 ranks (raises UserError when
    the layout cannot work, with the line training would print)."""
    from numpitron.cli import configs_from_args
    from numpitron.plan.__main__ import layout_of, parser
    from numpitron.plan.predict import plan
    args = parser().parse_args(flags)
    model, parallel, train = configs_from_args(args)
    return plan(model, parallel, train, layout_of(args, 4, model, parallel, train), device)


def measure(flags: list, iters: int) -> float:
    out = cluster("run", "-n", "4", "--", sys.executable, "benchmarks/benchmark.py", "--warmup", "2",
                  "--iters", str(iters), *flags)
    return json.loads(out.strip().splitlines()[-1])["ms_per_iter_median"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="default")
    p.add_argument("--hosts-of", default="4,2,1", help="ranks per host of each placement, e.g. 4,2,1")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        return probe()
    cpu = load_device("this-machine")
    intra, inter = scaled_rates(cpu.peak_flops)
    print(f"scale: {cpu.peak_flops / 1e9:.0f} GFLOP/s here over the A100's {A100.peak_flops / 1e12:.0f} TFLOP/s; "
          f"intra-host {8 * intra / 1e6:.0f} Mbit/s and inter-host {8 * inter / 1e6:.1f} Mbit/s per rank")
    print("| ranks per host | tp pp dp cp | crosses hosts | measured ms | predicted ms | predicted / measured "
          "| A100 predicted ms |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: |")
    rows = []
    for per_host in (int(r) for r in args.hosts_of.split(",")):
        hosts = 4 // per_host
        cluster("down", check=False)
        cluster("up", "--hosts", str(hosts), "--ranks-per-host", str(per_host),
                "--inter-host-rate", f"{8 * inter * per_host / 1e3:.0f}kbit", "--intra-host-rate", f"{8 * intra / 1e3:.0f}kbit")
        alpha_inter = latency(1) if hosts > 1 else 0.0
        alpha_intra = latency(2) if per_host > 1 else 0.0
        device = replace(cpu, ranks_per_host=per_host, intra_bandwidth=intra, inter_bandwidth=inter,
                         intra_latency=alpha_intra, inter_latency=alpha_inter)
        a100 = replace(A100, ranks_per_host=per_host)
        for mesh in MESHES:
            flags = MODELS[args.model] + BATCH + mesh_flags(mesh)
            try:
                planned, on_a100 = plan_step(flags, device), plan_step(flags, a100)
            except UserError as error:
                print(f"| {per_host} | {' '.join(map(str, mesh))} | rejected: {error} | | | | |")
                continue
            measured = measure(flags, args.iters)
            rows.append((per_host, mesh, measured, 1e3 * planned["step_s"], 1e3 * on_a100["step_s"]))
            print(f"| {per_host} | {' '.join(map(str, mesh))} | {', '.join(planned['groups_across_hosts']) or '-'} "
                  f"| {measured:.0f} | {1e3 * planned['step_s']:.0f} | {1e3 * planned['step_s'] / measured:.2f} "
                  f"| {1e3 * on_a100['step_s']:.3f} |", flush=True)
    cluster("down", check=False)
    ratios = [planned / measured for _, _, measured, planned, _ in rows]
    print(f"\npredicted / measured: median {statistics.median(ratios):.2f}, "
          f"{sum(abs(r - 1) <= 0.2 for r in ratios)} of {len(ratios)} within 20%")
    for per_host in sorted({r[0] for r in rows}, reverse=True):
        group = [r for r in rows if r[0] == per_host]
        order = [lambda r: r[2], lambda r: r[3], lambda r: r[4]]
        names = [" ".join("".join(map(str, r[1])) for r in sorted(group, key=key)) for key in order]
        print(f"{per_host} ranks per host, fastest first (tp pp dp cp): measured {names[0]}; "
              f"planned {names[1]}; planned on A100s {names[2]}")


if __name__ == "__main__":
    main()
