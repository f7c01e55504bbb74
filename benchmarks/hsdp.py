"""ZeRO-3, hybrid sharding (HSDP) and plain data parallelism on the scaled cluster, at
several inter-host rates: step time and the bytes host 0's link carried, beside the
planner's prediction and its crossover (docs/07-zero-2-and-3.md). Needs root.

    python benchmarks/hsdp.py                       # rates 4x, 1x, 1/4x the scaled InfiniBand
    python benchmarks/hsdp.py --rates 1,0.25 --iters 3

2 hosts x 2 ranks, dp = 4 of the default model, every rank in its own shaped namespace
(benchmarks/cluster_layouts.py's scale: a byte costs as many FLOPs here as on an A100
cluster). Layouts: ZeRO-3 over all 4 ranks; HSDP, ZeRO-3 over the S = 2 ranks of a host
and replicated across the 2 hosts; plain dp (MPI's all-reduce) and plain dp with the
two-level all-reduce. The planner's crossover: the inter-host rate below which it
predicts HSDP faster than ZeRO-3 by more than 10% (this machine's noise band).
One round: the machine is shared, so quote ratios of paired runs, not absolute times.
"""

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from cluster_layouts import BATCH, PREFIX, cluster, latency, measure, plan_step, scaled_rates  # noqa: E402

from numpitron.cluster import control  # noqa: E402
from numpitron.plan.devices import load_device  # noqa: E402

DP4 = ["--data-parallel-size", "4"]
LAYOUTS = {"ZeRO-3": DP4 + ["--zero-stage", "3"],
           "HSDP (S=2)": DP4 + ["--zero-stage", "3", "--data-parallel-shard-size", "2"],
           "dp": DP4,
           "dp, two-level": DP4 + ["--data-parallel-shard-size", "2", "--hierarchical-all-reduce"]}
MARGIN = 1.10
WARMUP = 2                  # cluster_layouts.measure's warm-up iterations


def link_bytes() -> int:
    return control.link_counters(control.load(PREFIX), 0)["tx_bytes"]


def crossover(device, flags_zero3: list, flags_hsdp: list) -> float:
    """The inter-host bytes/s per rank below which the planner has HSDP's step shorter
    than ZeRO-3's by more than MARGIN (bisection in log rate; both fall with the rate)."""
    def zero3_over_hsdp(rate):
        d = replace(device, inter_bandwidth=rate)
        return plan_step(flags_zero3, d)["step_s"] / plan_step(flags_hsdp, d)["step_s"]
    lo, hi = 1e3, 1e11
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if zero3_over_hsdp(mid) > MARGIN else (lo, mid)
    return lo


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="4,1,0.25", help="inter-host rates, as multiples of the scaled InfiniBand")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    cpu = load_device("this-machine")
    intra, infiniband = scaled_rates(cpu.peak_flops)
    base = replace(cpu, ranks_per_host=2, intra_bandwidth=intra)
    print(f"2 hosts x 2 ranks; intra-host {8 * intra / 1e6:.0f} Mbit/s per rank; scaled InfiniBand "
          f"{8 * infiniband / 1e6:.1f} Mbit/s per rank")
    print("| inter-host Mbit/s per rank | layout | measured ms | predicted ms | host 0 sent MB per step "
          "| planned MB per rank in groups that cross hosts | planned state MiB per rank |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = {}
    for multiple in (float(m) for m in args.rates.split(",")):
        inter = infiniband * multiple
        cluster("down", check=False)
        cluster("up", "--hosts", "2", "--ranks-per-host", "2", "--inter-host-rate", f"{8 * inter * 2 / 1e3:.0f}kbit",
                "--intra-host-rate", f"{8 * intra / 1e3:.0f}kbit")
        device = replace(base, inter_bandwidth=inter, inter_latency=latency(1), intra_latency=latency(2))
        for name, flags in LAYOUTS.items():
            flags = BATCH + flags
            planned = plan_step(flags, device)
            before = link_bytes()
            measured = measure(flags, args.iters)
            sent = (link_bytes() - before) / (WARMUP + args.iters)
            stage = planned["stages"][0]
            inter_planned = stage["tiers"].get("inter", {"bytes": 0.0})["bytes"]
            state = sum(stage[k] for k in ("params", "grads", "optimizer_state"))
            rows[multiple, name] = (measured, 1e3 * planned["step_s"])
            print(f"| {8 * inter / 1e6:.1f} | {name} | {measured:.0f} | {1e3 * planned['step_s']:.0f} | {sent / 1e6:.2f} "
                  f"| {inter_planned / 1e6:.2f} | {state / 2**20:.2f} |", flush=True)
        rows[multiple, "device"] = device
    cluster("down", check=False)
    some = rows[next(iter(float(m) for m in args.rates.split(","))), "device"]
    rate = crossover(some, BATCH + LAYOUTS["ZeRO-3"], BATCH + LAYOUTS["HSDP (S=2)"])
    print(f"\nplanned crossover: HSDP faster than ZeRO-3 by more than {MARGIN - 1:.0%} below "
          f"{8 * rate / 1e6:.1f} Mbit/s per rank ({rate / infiniband:.2f}x the scaled InfiniBand)")
    for multiple in (float(m) for m in args.rates.split(",")):
        zero3, hsdp = rows[multiple, "ZeRO-3"], rows[multiple, "HSDP (S=2)"]
        print(f"at {multiple:g}x: ZeRO-3 / HSDP measured {zero3[0] / hsdp[0]:.2f}, planned {zero3[1] / hsdp[1]:.2f}")
    print(json.dumps({"crossover_bytes_per_s": rate}))


if __name__ == "__main__":
    main()
