"""ZeRO stages 0-3 side by side on dp ranks: step time, memory per rank, bytes moved,
and how much of the dp traffic the backward hid (docs/09-zero-2-and-3.md).

    python benchmarks/zero_stages.py [--ranks 2] [--rounds 5] [--iters 10] [--json out.json]

Each round runs benchmarks/benchmark.py once per stage, in turn, so that the machine's
drift hits every stage alike; the table gives medians over rounds. "exposed" is the
time ranks spent waiting in dp collectives per iteration (fastest rank: the slowest
waits for everyone at the barrier too). ZeRO-2 and 3 also run with
--no-overlap-grad-reduce (no prefetch, every collective waited for at once), and
"hidden" is 1 - exposed / exposed without overlap. "model ms" is what the alpha-beta
model of this machine's calibrated profile (plan/profiles/this-machine.json) gives for
the same calls: calls x latency + bytes / bandwidth; waiting beyond it is ranks
arriving at different times.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RUNS = [("ZeRO-0", ["--zero-stage", "0"]), ("ZeRO-1", ["--zero-stage", "1"]), ("ZeRO-2", ["--zero-stage", "2"]),
        ("ZeRO-2, no overlap", ["--zero-stage", "2", "--no-overlap-grad-reduce"]), ("ZeRO-3", ["--zero-stage", "3"]),
        ("ZeRO-3, no overlap", ["--zero-stage", "3", "--no-overlap-grad-reduce"])]


def one_run(ranks: int, iters: int, flags: list) -> dict:
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "python"), "benchmarks/benchmark.py",
           "--data-parallel-size", str(ranks), "--iters", str(iters), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])


def exposed_dp_seconds(result: dict) -> float:
    """dp waiting per iteration on the rank that waited least."""
    return min(sum(v for k, v in rank.items() if k.startswith(("dp_cp.", "dp_shard.", "dp_replica.")))
               for rank in result["comm_seconds_per_iter_by_kind_per_rank"])


def unhidden_dp_seconds(result: dict) -> float:
    """What the dp reduce-scatters and all-gathers of one iteration would cost waited
    for in full, by the alpha-beta model (the all-gather after the update included)."""
    from numpitron.plan.devices import load_device
    device = load_device("this-machine")
    calls, nbytes = result["comm_calls_per_iter_by_kind"], result["comm_bytes_per_iter_by_kind"]
    kinds = [k for k in calls if k in ("dp_shard.reduce_scatter", "dp_shard.all_gather", "dp_cp.all_reduce")]
    return sum(calls[k] * device.intra_latency + nbytes[k] / device.intra_bandwidth for k in kinds)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--bucket-size", type=int, default=200_000,
                   help="elements per bucket: the default model fits one 1M bucket, which nothing can overlap")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = {name: [] for name, _ in RUNS}
    for _ in range(args.rounds):
        for name, flags in RUNS:
            results[name].append(one_run(args.ranks, args.iters, flags + ["--bucket-size", str(args.bucket_size)]))
    rows = {}
    for name, runs in results.items():
        memory = runs[0]["memory_bytes_per_rank"][0]
        rows[name] = {
            "step_ms": statistics.median(r["ms_per_iter_median"] for r in runs),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "exposed_dp_ms": 1e3 * statistics.median(exposed_dp_seconds(r) for r in runs),
            "unhidden_dp_ms": 1e3 * unhidden_dp_seconds(runs[0]),
            "dp_bytes_per_iter": sum(v for k, v in runs[0]["comm_bytes_per_iter_by_kind"].items() if k.startswith(("dp_cp.", "dp_shard.", "dp_replica."))),
            "memory_bytes": memory, "peak_bytes": sum(memory.values())}
    base = rows["ZeRO-0"]["step_ms"]
    for stage in ("ZeRO-2", "ZeRO-3"):      # measured against the same calls waited for at once
        rows[stage]["hidden_fraction"] = 1 - rows[stage]["exposed_dp_ms"] / rows[f"{stage}, no overlap"]["exposed_dp_ms"]
    print(f"dp = {args.ranks}, medians of {args.rounds} rounds x {args.iters} iterations (default model)")
    print(f"{'':20s} {'step ms':>8s} {'vs 0':>6s} {'exposed dp ms':>14s} {'model ms':>9s} {'hidden':>7s} {'dp MB/iter':>11s} "
          f"{'params':>7s} {'grads':>7s} {'adam':>7s} {'in-pass':>8s} {'peak MB':>8s}")
    for name, r in rows.items():
        m = r["memory_bytes"]
        print(f"{name:20s} {r['step_ms']:8.1f} {r['step_ms'] / base:6.3f} {r['exposed_dp_ms']:14.2f} "
              f"{r['unhidden_dp_ms']:9.2f} {100 * r.get('hidden_fraction', 0):6.0f}% "
              f"{r['dp_bytes_per_iter'] / 1e6:11.2f} {m['params'] / 1e6:7.2f} {m['grads'] / 1e6:7.2f} "
              f"{m['optimizer_state'] / 1e6:7.2f} {(m['gathered_params_peak'] + m['backward_grads_peak']) / 1e6:8.2f} "
              f"{r['peak_bytes'] / 1e6:8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"ranks": args.ranks, "rounds": args.rounds, "iters": args.iters,
                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
