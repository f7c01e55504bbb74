"""Training across a slow link, timed on the simulated cluster (docs/18-across-slow-links.md).
Needs root (network namespaces); one cluster at a time on a machine.

    python benchmarks/slow_links.py --loss-runs dp=RUNS/dp4 diloco-50=RUNS/diloco50 ...   # the sweep
    python benchmarks/slow_links.py --rates 1 --methods dp diloco-10 --iters 2 --no-repeat       # a smoke run

Two hosts of two ranks (dp = 4; DiLoCo's two replicas are the two hosts), the inter-host
link at the scaled InfiniBand rate of benchmarks/cluster_layouts.py times each of --rates
(1, 1/8, 1/64), the intra-host links at scaled NVLink. Methods: plain dp, int8 and PowerSGD
r = 4 gradients, DiLoCo H in {10, 50, 200}, streaming (F = 5, τ = 2, H = 50), both H = 50 also int8.

A run's validation loss does not depend on the link, so the loss comes from full runs
made off the cluster (--loss-runs NAME=DIR, their metrics.jsonl); the cluster times
windows. In order:

1. Calibrate (top rate, slow_links_calibrate.py): a step's compute (a DiLoCo step with
   no exchange: nothing but the loss crosses hosts) and each method's own work; at every
   rate, the card's both-way share e for each message the methods swap across hosts
   (two_way_probe.py; --one-way skips it and prices every byte at β).
2. Predict, before timing anything (numpitron/plan/crossover.py): each method's seconds
   per iteration at each rate and the rates where it and plain dp swap places. Printed, saved.
3. Time windows (benchmarks/benchmark.py on random tokens, no evaluation): dp, int8 and
   PowerSGD a warm-up then K iterations, K from the prediction so a window lasts about
   --window seconds; DiLoCo and streaming 5 warm-up steps then whole rounds of H steps,
   so the exchange is counted once a round. Plain dp's top-rate window runs twice (with
   --repeat-all, at every rate): the two differ by the noise band. Host 0's link counters over the window (payload: frames
   less their TCP/IP headers, both ways) against the formula's bytes, computed from the
   window's own counted bytes; the link's busiest rate sampled every --sample seconds.

Projected wall time to 3,000 iterations is 3,000 x the window's seconds per iteration.
Writes --out (JSON) and, with matplotlib, docs/figures/slow_links_{bytes,time}.svg.
"""

import argparse
import json
import sys
from fractions import Fraction
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from cluster_layouts import cluster, scaled_cluster, scaled_rates  # noqa: E402
from figures import machine  # noqa: E402
from link_sampler import Sampler  # noqa: E402
from slow_links_figures import figures  # noqa: E402
from two_way_probe import probe  # noqa: E402

from numpitron.cluster import control  # noqa: E402
from numpitron.cluster.network import ClusterSpec  # noqa: E402
from numpitron.plan.crossover import TwoWay, crossings, method, seconds_per_iteration, wins  # noqa: E402
from numpitron.plan.devices import load_device  # noqa: E402

PREFIX = "npt-slow-"
DP4, DILOCO = ["--data-parallel-size", "4"], ["--diloco-replicas", "2"]
STREAMING = DILOCO + ["--diloco-inner-steps", "50", "--diloco-fragments", "5", "--diloco-overlap-steps", "2"]
METHODS = {
    "dp": [],
    "int8": ["--grad-compression", "int8"],
    "powersgd": ["--grad-compression", "powersgd", "--powersgd-rank", "4"],
    "diloco-10": DILOCO + ["--diloco-inner-steps", "10"],
    "diloco-50": DILOCO + ["--diloco-inner-steps", "50"],
    "diloco-200": DILOCO + ["--diloco-inner-steps", "200"],
    "streaming": STREAMING,
    "diloco-50-int8": DILOCO + ["--diloco-inner-steps", "50", "--diloco-outer-dtype", "int8"],
    "streaming-int8": STREAMING + ["--diloco-outer-dtype", "int8"],
}
PER_HOST, PROJECTED_ITERS, DILOCO_WARMUP = 2, 3000, 5       # 5: no multiple of any H, no fragment's offset


def inner_steps(name: str) -> int:
    flags = METHODS[name]
    return int(flags[flags.index("--diloco-inner-steps") + 1]) if "--diloco-inner-steps" in flags else 0


def groups(name: str) -> dict:
    """{group: (ranks, hosts)}: plain dp's group spans both hosts; a DiLoCo replica's is
    one host, and its replicas meet across the link."""
    if inner_steps(name):
        return {"dp_cp": (2, 1), "diloco": (2, 2), "diloco_metrics": (2, 2)}
    return {"dp_cp": (4, 2)}


def planned(name: str, own: dict) -> tuple:
    """(Method, host 0's link bytes per iteration) from the planner's bytes and calls."""
    from numpitron.cli import configs_from_args
    from numpitron.plan.__main__ import parser
    from numpitron.plan.accounting import Rank
    from numpitron.plan.traffic import comm_bytes, comm_calls
    model, parallel, train = configs_from_args(parser().parse_args(DP4 + METHODS[name]))
    rank = Rank(1, 1, 4, 1)
    streaming = (train.diloco_fragments, train.diloco_inner_steps, train.diloco_overlap_steps) \
        if inner_steps(name) else (1, 1, 0)
    return method(name, comm_bytes(model, parallel, train, rank), comm_calls(model, parallel, train, rank),
                  groups(name), PER_HOST, own.get(name, 0.0), streaming)


def frame_efficiency(inter: float, intra: float) -> float:
    """Payload per byte a card sends at the cluster's frame size (network.py): a full frame
    of MTU + 14 bytes carries MTU - 52 of the job's."""
    mtu = ClusterSpec("x", 2, PER_HOST, f"{8 * inter * PER_HOST / 1e3:.0f}kbit", f"{8 * intra / 1e3:.0f}kbit").frame_bytes
    return (mtu - 52) / (mtu + 14)


def card_rate(inter: float, intra: float, rate: str) -> float:
    """A rank's card at `rate` of the scaled rate, in payload bytes/s."""
    beta = inter * float(Fraction(rate))
    return beta * frame_efficiency(beta, intra)


def probe_sizes(names: list) -> list:
    """The messages the methods swap both ways across hosts, to two figures, 16 kB and up
    (below that α, not e, prices them)."""
    sizes = {float(f"{msg:.2g}") for name in names for _, msg in planned(name, {})[0].both_ways}
    return sorted(int(n) for n in sizes if n >= 16_000)


def two_way(probes: dict, inter: float, intra: float) -> TwoWay:
    """e at each probed rate and message: the model's n / β over the both-way time."""
    return TwoWay({card_rate(inter, intra, rate): {r["bytes"]: r["bytes"] / card_rate(inter, intra, rate) /
                                                   r["two_way_s"] for r in rows} for rate, rows in probes.items()})


def predict(args, calibration: dict, intra: float, inter: float, probes: dict) -> dict:
    """Every method's seconds per iteration at every rate, and the rates where it and
    plain dp swap places, with each card's both-way share e as probed."""
    beta_in = intra * frame_efficiency(inter, intra)
    e = two_way(probes, inter, intra) if probes else None
    plans = {name: planned(name, calibration["own_s"]) for name in METHODS}
    # the calibrating step also all-reduced inside its host and averaged the loss across: not compute
    inner = plans["diloco-200"][0]
    compute = calibration["compute_s"] - inner.inside / beta_in - (inner.messages) * args.alpha
    out = {"alpha_s": args.alpha, "compute_s": compute, "beta_inside": beta_in, "methods": {},
           "two_way": e.probes if e else None}
    dp = plans["dp"][0]
    low, high = card_rate(inter, intra, "1/128"), card_rate(inter, intra, "16")
    for name, (m, link) in plans.items():
        at = {rate: seconds_per_iteration(m, compute, args.alpha, card_rate(inter, intra, rate), beta_in, e)
              for rate in args.rates}
        meet = [] if name == "dp" else crossings(m, dp, compute, args.alpha, beta_in, e, low, high)
        below = name != "dp" and wins(m, dp, low, compute, args.alpha, beta_in, e)     # on the slowest card
        out["methods"][name] = {"seconds_per_iter": at, "crossing_bytes_per_iter": m.crossing,
                                "link_bytes_per_iter": link, "own_s": m.own_s, "both_ways": m.both_ways,
                                "crossings_bytes_per_s": meet, "wins_at_lowest": below,
                                "crossings_x_scaled": [b / card_rate(inter, intra, "1") for b in meet]}
    return out


def window(name: str, args, spec, predicted_s: float) -> dict:
    """benchmark.py over one window: whole rounds for DiLoCo, else about --window seconds."""
    H = inner_steps(name)
    if H:
        warmup, iters = DILOCO_WARMUP, H * max(1, round(args.min_diloco_steps / H))
    else:
        warmup = 2 if predicted_s < 5 else 1
        iters = args.iters or max(3, min(12, round(args.window / predicted_s)))
    (sampler := Sampler(spec, args.sample)).start()
    out = cluster("run", "-n", "4", "--", sys.executable, "benchmarks/benchmark.py", "--warmup", str(warmup),
                  "--iters", str(iters), "--cluster-prefix", args.prefix, *DP4, *METHODS[name], prefix=args.prefix)
    sampler.stop.set(), sampler.join()
    run = json.loads(out.strip().splitlines()[-1])
    counted = run["comm_bytes_per_iter_by_kind"]
    formula = method(name, counted, run["comm_calls_per_iter_by_kind"], groups(name), PER_HOST)[1]
    payload = sum(run["host_link_payload_bytes_per_iter"])          # host 0's out + host 1's out = host 0 both ways
    step = run["ms_per_iter_median"] / 1e3
    return {"method": name, "warmup": warmup, "iters": iters, "seconds_per_iter": run["ms_per_iter_window"] / 1e3,
            "median_step_s": step, "link_payload_bytes_per_iter": payload, "formula_bytes_per_iter": formula,
            "link_over_formula": payload / formula, "counted_bytes_per_iter": counted,
            "peak_bytes_per_s_step_window": sampler.peak(max(step, args.sample)),
            "peak_bytes_per_s_sample": sampler.peak(args.sample), "largest_burst_bytes": sampler.largest_burst(),
            "load": run["loadavg_1min_at_start"]}


def loss_curves(specs: list) -> dict:
    """{method: [(iteration, validation loss)]} from full runs' metrics.jsonl."""
    curves = {}
    for spec in specs:
        name, path = spec.split("=", 1)
        rows = [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        curves[name] = [(r["iter"], r["val_loss"]) for r in rows if "val_loss" in r]
    return curves


def report(w: dict, predicted: float) -> None:
    print(f"{w['rate']:>5} {w['method']:<11} measured {w['seconds_per_iter']:7.3f} s/iter, predicted "
          f"{predicted:7.3f}; projected {PROJECTED_ITERS} iters {w['seconds_per_iter'] * PROJECTED_ITERS / 60:6.1f} min; "
          f"link/formula {w['link_over_formula']:.3f}; peak {w['peak_bytes_per_s_step_window'] / 1e6:.2f} MB/s",
          flush=True)


def summary(data: dict) -> dict:
    """The noise band (two dp windows' difference over their mean, at each rate run twice); at each
    rate, which methods beat plain dp, measured and predicted, and DiLoCo's peak over streaming's."""
    bands = {}
    for rate in data["rates"]:
        dps = [w["seconds_per_iter"] for w in data["windows"] if w["method"] == "dp" and w["rate"] == rate]
        if len(dps) > 1:
            bands[rate] = abs(dps[0] - dps[1]) / (sum(dps) / 2)
    wins, peaks, bursts = {}, {}, {}
    for rate in data["rates"]:
        timed = {w["method"]: w["seconds_per_iter"] for w in data["windows"] if w["rate"] == rate}
        predicted = {n: m["seconds_per_iter"][rate] for n, m in data["prediction"]["methods"].items()}
        peak = {w["method"]: w["peak_bytes_per_s_step_window"] for w in data["windows"] if w["rate"] == rate}
        burst = {w["method"]: w["largest_burst_bytes"] for w in data["windows"] if w["rate"] == rate}
        if {"diloco-50", "streaming"} <= set(peak):           # the goal: lowered by F, where the link keeps up
            peaks[rate] = peak["diloco-50"] / peak["streaming"]
            bursts[rate] = burst["diloco-50"] / burst["streaming"]      # lowered by F at any rate
        if "dp" in timed:
            wins[rate] = {n: {"measured": t < timed["dp"], "predicted": predicted[n] < predicted["dp"],
                              "measured_over_predicted": t / predicted[n]} for n, t in timed.items() if n != "dp"}
    return {"noise_band": bands.get(data["rates"][0]), "noise_band_by_rate": bands, "beats_dp": wins, "peak_diloco50_over_streaming": peaks,
            "largest_burst_diloco50_over_streaming": bursts}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["1", "1/8", "1/64"], help="fractions of the scaled InfiniBand rate")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--loss-runs", nargs="*", default=[], metavar="NAME=DIR", help="full runs' output directories")
    p.add_argument("--window", type=float, default=45.0, help="seconds a dp, int8 or PowerSGD window aims at")
    p.add_argument("--iters", type=int, default=0, help="timed iterations of dp, int8, PowerSGD (0: from --window)")
    p.add_argument("--min-diloco-steps", type=int, default=20, help="DiLoCo windows: whole rounds, at least this many")
    p.add_argument("--no-repeat", action="store_true", help="skip the second top-rate dp window (the noise band)")
    p.add_argument("--repeat-all", action="store_true", help="a second dp window at every rate, not only the top")
    p.add_argument("--one-way", action="store_true", help="price every byte at β: no two-way probe")
    p.add_argument("--probe-reps", type=int, default=3, help="both-way probes per message and rate (median)")
    p.add_argument("--alpha", type=float, default=1e-4, help="seconds per message across hosts (chapter 9's fits)")
    p.add_argument("--sample", type=float, default=0.25, help="seconds between link counter samples")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / "slow_links.json")
    p.add_argument("--figures", type=Path, default=REPO / "docs" / "figures")
    p.add_argument("--prefix", default=PREFIX)
    p.add_argument("--redraw", action="store_true", help="draw the figures again from --out, running nothing")
    args = p.parse_args()
    if args.redraw:
        return figures(json.loads(args.out.read_text()), args.figures)
    intra, inter = scaled_rates(load_device("this-machine").peak_flops)
    data = {"command": sys.argv, "cpu": machine(), "rates": args.rates, "inter_bytes_per_s_per_rank": inter,
            "intra_bytes_per_s_per_rank": intra, "loss_runs": loss_curves(args.loss_runs), "windows": []}
    save = lambda: args.out.write_text(json.dumps(data, indent=1) + "\n")      # noqa: E731
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sizes, probes = probe_sizes(args.methods), {}
    try:
        for k, rate in enumerate(args.rates):              # the link, measured before any window is timed
            scaled_cluster(2, PER_HOST, inter * float(Fraction(rate)), intra, prefix=args.prefix)
            if k == 0:
                out = cluster("run", "-n", "4", "--", sys.executable, "benchmarks/slow_links_calibrate.py",
                              prefix=args.prefix)
                data["calibration"] = json.loads(out.strip().splitlines()[-1])
            if not args.one_way and sizes:
                probes[rate] = probe(sizes, args.probe_reps, args.prefix, one_way_too=False)
        data["two_way_probes"] = probes
        data["prediction"] = predict(args, data["calibration"], intra, inter, probes)
        save()
        print("predicted before timing:", json.dumps(data["prediction"], indent=1), flush=True)
        for k, rate in enumerate(args.rates):
            scaled_cluster(2, PER_HOST, inter * float(Fraction(rate)), intra, prefix=args.prefix)
            spec = control.load(args.prefix)
            predicted = {n: m["seconds_per_iter"][rate] for n, m in data["prediction"]["methods"].items()}
            repeats = [(n, 2 if n == "dp" and (k == 0 or args.repeat_all) and not args.no_repeat else 1)
                       for n in args.methods]
            for name, times in repeats:
                for _ in range(times):
                    w = {"rate": rate, **window(name, args, spec, predicted[name])}
                    data["windows"].append(w)
                    report(w, predicted[name])
                    save()
    finally:
        cluster("down", prefix=args.prefix, check=False)
    if "prediction" in data:
        data["summary"] = summary(data)
        save()
        print("summary:", json.dumps(data["summary"], indent=1))
    figures(data, args.figures)


if __name__ == "__main__":
    main()
