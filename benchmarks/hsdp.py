"""ZeRO-3, hybrid sharding (HSDP) and plain data parallelism on the scaled cluster, at
several inter-host rates: step time and the bytes host 0's link carried, beside the
planner's prediction and its crossover (docs/09-zero-2-and-3.md). Needs root.

    python benchmarks/hsdp.py --prefix b-                     # rates 1/4x to 256x the scaled InfiniBand
    python benchmarks/hsdp.py --prefix b- --rates 1,16 --rounds 2 --out /tmp/hsdp.json

2 hosts x 2 ranks, dp = 4 of the default model, every rank in its own shaped namespace
(benchmarks/cluster_layouts.py's scale: a byte costs as many FLOPs here as on an A100
cluster). Layouts: ZeRO-3 over all 4 ranks; HSDP, ZeRO-3 over the S = 2 ranks of a host
and replicated across the 2 hosts; plain dp (MPI's all-reduce) and plain dp with the
two-level all-reduce. At each rate the links' per-message latency alpha and rate are
fitted first (cluster_layouts.link_fit); the planner prices every layout with the shaped
rate and the fitted alpha, and again at the rate the links delivered to the fit.
The layouts run in rounds, each round every layout once in a rotated order, so the
ratios of one round are paired (the machine is shared: its load average is recorded
beside every rate); the table quotes medians over rounds. The planner's crossover is
the inter-host rate below which it predicts HSDP faster than ZeRO-3 by more than 10%,
with the fitted alpha and, to show what alpha does, with alpha = 0. --out writes
everything as JSON: benchmarks/figures.py draws docs/figures/hsdp_rates.svg from it.
"""

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import cluster_layouts  # noqa: E402
from cluster_layouts import BATCH, cluster, link_fit, measure, scaled_rates  # noqa: E402
from cluster_prediction import plan_step  # noqa: E402

from numpitron.cluster import control  # noqa: E402
from numpitron.plan.devices import load_device  # noqa: E402

DP4 = ["--data-parallel-size", "4"]
LAYOUTS = {"ZeRO-3": DP4 + ["--zero-stage", "3"],
           "HSDP (S=2)": DP4 + ["--zero-stage", "3", "--data-parallel-shard-size", "2"],
           "dp": DP4,
           "dp, two-level": DP4 + ["--data-parallel-shard-size", "2", "--hierarchical-all-reduce"]}
MARGIN = 1.10
WARMUP = 2                  # cluster_layouts.measure's warm-up iterations
OUT = REPO / "docs" / "figures" / "hsdp.json"


def link_bytes() -> int:
    return control.link_counters(control.load(cluster_layouts.PREFIX), 0)["tx_bytes"]


def crossover(device, flags_zero3: list, flags_hsdp: list) -> float | None:
    """The inter-host bytes/s per rank below which the planner has HSDP's step shorter
    than ZeRO-3's by more than MARGIN (bisection in log rate; both fall with the rate);
    None when HSDP wins by more than that at every rate up to 100 GB/s."""
    def zero3_over_hsdp(rate):
        d = replace(device, inter_bandwidth=rate)
        return plan_step(flags_zero3, d)["step_s"] / plan_step(flags_hsdp, d)["step_s"]
    lo, hi = 1e3, 1e11
    if zero3_over_hsdp(hi) > MARGIN:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if zero3_over_hsdp(mid) > MARGIN else (lo, mid)
    return lo


def one_rate(multiple: float, infiniband: float, intra: float, base, rounds: int, iters: int) -> dict:
    """Bring the cluster up at this inter-host rate, fit its links, run every layout
    `rounds` times (rotated order), and plan each with the fitted links."""
    inter = infiniband * multiple
    cluster("down", check=False)
    cluster("up", "--hosts", "2", "--ranks-per-host", "2", "--inter-host-rate", f"{8 * inter * 2 / 1e3:.0f}kbit",
            "--intra-host-rate", f"{8 * intra / 1e3:.0f}kbit")
    (alpha_inter, beta_inter), (alpha_intra, beta_intra) = link_fit(1), link_fit(2)
    device = replace(base, inter_bandwidth=inter, inter_latency=alpha_inter, intra_latency=alpha_intra)
    # What the links delivered to the sweep, when less than their shaped rate: the
    # kernel's TCP runs on the cores the ranks share.
    delivered = replace(device, inter_bandwidth=min(inter, beta_inter), intra_bandwidth=min(intra, beta_intra))
    result = {"multiple": multiple, "inter_mbit": 8 * inter / 1e6, "alpha_inter_s": alpha_inter,
              "alpha_intra_s": alpha_intra, "fitted_inter_mbit": 8 * beta_inter / 1e6,
              "fitted_intra_mbit": 8 * beta_intra / 1e6,
              "load": [os.getloadavg()[0]], "layouts": {}}
    names = list(LAYOUTS)
    for name in names:
        planned = plan_step(BATCH + LAYOUTS[name], device)
        stage = planned["stages"][0]
        result["layouts"][name] = {
            "ms": [], "sent_bytes": [], "planned_ms": 1e3 * planned["step_s"],
            "planned_ms_no_alpha": 1e3 * plan_step(BATCH + LAYOUTS[name], replace(device, inter_latency=0.0,
                                                                                  intra_latency=0.0))["step_s"],
            "planned_ms_delivered": 1e3 * plan_step(BATCH + LAYOUTS[name], delivered)["step_s"],
            "planned_inter_bytes": stage["tiers"].get("inter", {"bytes": 0.0})["bytes"],
            "state_bytes": sum(stage[k] for k in ("params", "grads", "optimizer_state"))}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            before = link_bytes()
            ms = measure(BATCH + LAYOUTS[name], iters)
            entry = result["layouts"][name]
            entry["ms"].append(ms)
            entry["sent_bytes"].append((link_bytes() - before) / (WARMUP + iters))
        result["load"].append(os.getloadavg()[0])
    return result


def appended(earlier: list, later: list) -> list:
    """Earlier runs' rounds followed by this run's, rate by rate (the rates must match);
    each round stays paired, and the planner's numbers are this run's."""
    assert [r["multiple"] for r in earlier] == [r["multiple"] for r in later], "--append needs the same --rates"
    for old, new in zip(earlier, later):
        new["load"] = old["load"] + new["load"]
        for name, entry in new["layouts"].items():
            for key in ("ms", "sent_bytes"):
                entry[key] = old["layouts"][name][key] + entry[key]
    return later


def paired(result: dict, a: str, b: str) -> float:
    """The median over rounds of a's step over b's in the same round."""
    return statistics.median(x / y for x, y in zip(result["layouts"][a]["ms"], result["layouts"][b]["ms"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0.25,1,4,16,64,256", help="inter-host rates, as multiples of the scaled InfiniBand")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every layout at each rate (paired ratios)")
    p.add_argument("--prefix", default=cluster_layouts.PREFIX, help="the cluster's names start with this")
    p.add_argument("--out", default=str(OUT), help="the JSON the figure is drawn from")
    p.add_argument("--append", action="store_true", help="add this run's rounds to those --out holds at the same rates")
    args = p.parse_args()
    cluster_layouts.PREFIX = args.prefix
    cpu = load_device("this-machine")
    intra, infiniband = scaled_rates(cpu.peak_flops)
    base = replace(cpu, ranks_per_host=2, intra_bandwidth=intra)
    print(f"2 hosts x 2 ranks; intra-host {8 * intra / 1e6:.0f} Mbit/s per rank; scaled InfiniBand "
          f"{8 * infiniband / 1e6:.1f} Mbit/s per rank; {os.cpu_count()} cores", flush=True)
    rates = []
    try:
        for multiple in (float(m) for m in args.rates.split(",")):
            rates.append(one_rate(multiple, infiniband, intra, base, args.rounds, args.iters))
            print(json.dumps(rates[-1]), flush=True)
    finally:
        cluster("down", check=False)
    if args.append:
        rates = appended(json.loads(Path(args.out).read_text())["rates"], rates)
    alpha = statistics.median(r["alpha_inter_s"] for r in rates)
    device = replace(base, inter_latency=alpha, intra_latency=statistics.median(r["alpha_intra_s"] for r in rates))
    zero3, hsdp = BATCH + LAYOUTS["ZeRO-3"], BATCH + LAYOUTS["HSDP (S=2)"]
    planned = {"with_alpha": crossover(device, zero3, hsdp),
               "no_alpha": crossover(replace(device, inter_latency=0.0, intra_latency=0.0), zero3, hsdp)}
    report(rates, planned, infiniband, alpha)
    Path(args.out).write_text(json.dumps({"infiniband_mbit": 8 * infiniband / 1e6, "margin": MARGIN, "alpha_inter_s": alpha,
                                          "crossover_mbit": {k: v and 8 * v / 1e6 for k, v in planned.items()},
                                          "rates": rates}, indent=1) + "\n")


def report(rates: list, planned: dict, infiniband: float, alpha: float) -> None:
    print("\n| inter-host Mbit/s per rank | load | ZeRO-3 ms | HSDP ms | dp ms | dp two-level ms | ZeRO-3 / HSDP "
          "measured | planned | planned, alpha = 0 | planned at the delivered rates | two-level / dp | links delivered Mbit/s: inter, intra | host 0 sent MB: ZeRO-3, HSDP, dp, two-level |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rates:
        lay = r["layouts"]
        med = {name: statistics.median(entry["ms"]) for name, entry in lay.items()}
        sent = ", ".join(f"{statistics.median(entry['sent_bytes']) / 1e6:.2f}" for entry in lay.values())
        print(f"| {r['inter_mbit']:.1f} ({r['multiple']:g}x) | {statistics.median(r['load']):.1f} | {med['ZeRO-3']:.0f} "
              f"| {med['HSDP (S=2)']:.0f} | {med['dp']:.0f} | {med['dp, two-level']:.0f} "
              f"| {paired(r, 'ZeRO-3', 'HSDP (S=2)'):.2f} "
              f"| {lay['ZeRO-3']['planned_ms'] / lay['HSDP (S=2)']['planned_ms']:.2f} "
              f"| {lay['ZeRO-3']['planned_ms_no_alpha'] / lay['HSDP (S=2)']['planned_ms_no_alpha']:.2f} "
              f"| {lay['ZeRO-3']['planned_ms_delivered'] / lay['HSDP (S=2)']['planned_ms_delivered']:.2f} "
              f"| {paired(r, 'dp, two-level', 'dp'):.2f} | {r['fitted_inter_mbit']:.0f}, {r['fitted_intra_mbit']:.0f} | {sent} |")
    print(f"\nfitted inter-host alpha (median over rates): {1e6 * alpha:.0f} us")
    for key, rate in planned.items():
        where = ("HSDP faster by more than 10% at every rate" if rate is None else
                 f"below {8 * rate / 1e6:.1f} Mbit/s per rank ({rate / infiniband:.2f}x the scaled InfiniBand)")
        print(f"planned crossover ({key.replace('_', ' ')}): {where}")


if __name__ == "__main__":
    main()
