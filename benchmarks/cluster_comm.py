"""Ring against Ulysses against hybrid context parallelism, and tensor-parallel overlap on
against off, on the simulated cluster scaled to an A100 cluster (docs/12-context-parallelism.md,
docs/04-tensor-parallelism.md). Needs root.

    python benchmarks/cluster_comm.py cp --inter-scale 1,0.5 --rounds 3 --prefix me-
    python benchmarks/cluster_comm.py tp-overlap --inter-scale 1,0.5 --rounds 3 --prefix me-

The links are benchmarks/cluster_layouts.py's: per rank, the A100's NVLink and InfiniBand
bandwidths times this CPU's FLOP/s over the A100's, every rank in its own shaped
namespace; --inter-scale multiplies the inter-host rate (1: the A100's, 0.5: a link half
as fast). Each case runs benchmarks/benchmark.py (cp) or benchmarks/tp_overlap.py
(tp-overlap) through `cluster run` with --cluster-prefix, so rank 0 also reads the bytes
every host's link sent during the timed steps. The variants of a case run one after the
other in every round, in reversed order on odd rounds, so a pair of runs sees nearly the
same load from other jobs; the summary is the median over rounds and the median of the
paired ratios to the case's first variant. Before every round a probe measures what a
host's link really carries: rank i and rank i + n/2, on the other host, exchange 4 MB.
Prints one JSON line per run and probe, then a Markdown table (`cluster_comm.py table
--log FILE` prints it again from those lines).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import cluster_layouts as layouts
from cluster_layouts import cluster, scaled_cluster, scaled_rates

from numpitron.plan.devices import load_device

CP_RUN = ["--seq-len", "256", "--micro-batch-size", "4", "--warmup", "1", "--iters", "3"]
CP_TYPES = {"ring": ["--context-parallel-type", "ring"], "ulysses": ["--context-parallel-type", "ulysses"],
            "hybrid U=2": ["--context-parallel-type", "hybrid", "--ulysses-size", "2"]}
# (case, hosts and ranks per host of the cluster, ranks of the run, ranks per host of the run, flags, variants)
CASES = {
    "cp": [("cp=2 in a host", (2, 2), 2, 2, ["--context-parallel-size", "2"], ["ring", "ulysses"]),
           ("cp=4 on 2 hosts x 2", (2, 2), 4, 2, ["--context-parallel-size", "4"], ["ring", "ulysses", "hybrid U=2"]),
           ("cp=2 across hosts", (2, 1), 2, 1, ["--context-parallel-size", "2"], ["ring", "ulysses"])],
    "tp-overlap": [("tp=2 in a host", (2, 2), 2, 2, ["--tensor-parallel-size", "2"], ["paired steps"]),
                   ("tp=2 across hosts", (2, 1), 2, 1, ["--tensor-parallel-size", "2"], ["paired steps"])],
}


def run_once(what: str, n: int, per_host: int, flags: list, variant: str, iters: int, prefix: str) -> dict:
    if what == "cp":
        script, extra = "benchmarks/benchmark.py", CP_RUN + CP_TYPES[variant]
    else:
        script, extra = "benchmarks/tp_overlap.py", ["--warmup", "1", "--iters", str(iters)]
    out = cluster("run", "-n", str(n), "--per-host", str(per_host), "--", sys.executable, script, *flags, *extra,
                  "--cluster-prefix", prefix, prefix=prefix)
    text = out[out.index("{"):]                         # tp_overlap.py prints its object over several lines
    return json.loads(text.strip().splitlines()[-1] if what == "cp" else text)


def probe(megabytes: int = 4, reps: int = 3) -> None:
    """Under `cluster run`: rank i and rank i + n/2 (on the other host) exchange a buffer;
    prints the payload bytes per second each rank moved, the median of `reps`."""
    import numpy as np
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    peer = (rank + n // 2) % n
    out, into = np.ones(megabytes * 2**18, np.float32), np.empty(megabytes * 2**18, np.float32)
    times = []
    for _ in range(reps + 1):
        world.Barrier()
        start = time.perf_counter()
        world.Sendrecv(out, peer, recvbuf=into, source=peer)
        times.append(time.perf_counter() - start)
    rates = world.gather(out.nbytes / statistics.median(times[1:]), root=0)
    if rank == 0:
        print(json.dumps({"probe_bytes_per_s_per_rank": statistics.median(rates)}))


def link_rate(n: int, per_host: int, prefix: str) -> float:
    """Payload bytes per second a host's link carried in the probe, all its ranks together."""
    out = cluster("run", "-n", str(n), "--per-host", str(per_host), "--", sys.executable, __file__, "--probe",
                  prefix=prefix)
    return per_host * json.loads(out.strip().splitlines()[-1])["probe_bytes_per_s_per_rank"]


def summary_cp(runs: list) -> dict:
    """Median step time, seconds in cp collectives, link payload and counted cp bytes."""
    def cp_seconds(r):
        return statistics.mean(sum(v for k, v in rank.items() if k.startswith("cp"))
                               for rank in r["comm_seconds_per_iter_by_kind_per_rank"])
    return {"ms": statistics.median(r["ms_per_iter_median"] for r in runs),
            "cp_comm_ms": statistics.median(1e3 * cp_seconds(r) for r in runs),
            "link_payload_mb": [round(statistics.median(r["host_link_payload_bytes_per_iter"][h] for r in runs) / 1e6, 3)
                                for h in range(len(runs[0]["host_link_payload_bytes_per_iter"]))],
            "cp_counted_mb_rank0": round(sum(v for k, v in runs[0]["comm_bytes_per_iter_by_kind"].items()
                                             if k.startswith("cp") and not k.endswith("recv")) / 1e6, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=sorted(CASES) + ["table"], help="table: rebuild the table from --log")
    p.add_argument("--log", help="with `table`: a file of this script's JSON lines")
    p.add_argument("--prefix", default=layouts.PREFIX, help="the cluster's prefix (default %(default)s)")
    p.add_argument("--inter-scale", default="1", help="inter-host rates as fractions of the A100's, e.g. 1,0.5")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=8, help="tp-overlap: paired steps per run")
    p.add_argument("--cases", default=None, help="only the cases whose name contains this")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    if "--probe" in sys.argv:
        return probe()
    args = p.parse_args()
    if args.what == "table":
        return print_table(*from_log(args.log))
    cpu = load_device("this-machine")
    intra, inter_a100 = scaled_rates(cpu.peak_flops)
    cases = [c for c in CASES[args.what] if not args.cases or args.cases in c[0]]
    table, probes = [], []
    for scale in (float(s) for s in args.inter_scale.split(",")):
        inter = inter_a100 * scale
        for shape in sorted({c[1] for c in cases}, reverse=True):
            scaled_cluster(*shape, inter, intra, args.prefix)
            runs = {}
            for round_ in range(args.rounds):
                hosts, per_host = shape
                rate = link_rate(hosts * per_host, per_host, args.prefix)
                probes.append({"inter_mbit_per_rank": round(8 * inter / 1e6, 1), "shape": shape, "round": round_,
                               "host_link_nominal_mb_per_s": round(inter * per_host / 1e6, 3),
                               "host_link_probe_payload_mb_per_s": round(rate / 1e6, 3),
                               "loadavg_now": round(os.getloadavg()[0], 2)})
                print(json.dumps(probes[-1]), flush=True)
                for name, _, n, per_host, flags, variants in (c for c in cases if c[1] == shape):
                    for variant in (variants if round_ % 2 == 0 else variants[::-1]):
                        result = run_once(args.what, n, per_host, flags, variant, args.iters, args.prefix)
                        result["loadavg_now"] = round(os.getloadavg()[0], 2)
                        runs.setdefault((name, variant), []).append(result)
                        print(json.dumps({"inter_mbit_per_rank": round(8 * inter / 1e6, 1), "case": name,
                                          "variant": variant, "round": round_, **result}), flush=True)
            table += [(8 * inter / 1e6, name, variant, rs) for (name, variant), rs in runs.items()]
    cluster("down", prefix=args.prefix, check=False)
    print(f"\nintra-host {8 * intra / 1e6:.0f} Mbit/s per rank")
    print_table(args.what, table, probes)


def from_log(path: str) -> tuple[str, list, list]:
    """The runs a previous invocation printed, grouped as `main` groups them."""
    runs, probes = {}, []
    for line in Path(path).read_text().splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if "shape" in r:
                probes.append(r)
                continue
            runs.setdefault((r["inter_mbit_per_rank"], r["case"], r["variant"]), []).append(r)
    what = "cp" if any(key[2] == "ring" for key in runs) else "tp-overlap"
    return what, [(*key, rs) for key, rs in runs.items()], probes


def median_of(key: str, runs: list) -> float:
    """The median over the runs that report `key` (older logs lack the newer keys)."""
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else float("nan")


def print_table(what: str, table: list, probes: list) -> None:
    for rate, shape in sorted({(p["inter_mbit_per_rank"], tuple(p["shape"])) for p in probes}, reverse=True):
        ps = [p for p in probes if (p["inter_mbit_per_rank"], tuple(p["shape"])) == (rate, shape)]
        print(f"{rate} Mbit/s per rank, {shape[0]} hosts x {shape[1]}: a host's link nominal "
              f"{ps[0]['host_link_nominal_mb_per_s']} MB/s, probed payload "
              f"{', '.join(str(p['host_link_probe_payload_mb_per_s']) for p in ps)} MB/s")
    loads = [r["loadavg_now"] for *_, rs in table for r in rs] + [p["loadavg_now"] for p in probes]
    print(f"load average during the runs {min(loads):.1f} to {max(loads):.1f} (this machine's cores: {os.cpu_count()})")
    if what == "cp":
        print("| inter Mbit/s per rank | case | type | step ms | paired ratio to ring (range) | paired ms less than ring "
              "| cp comm ms | link payload MB per host | cp MB counted, rank 0 |")
        print("| ---: | --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
        for rate, name, variant, rs in table:
            ring = next(r for r_, n_, v_, r in table if r_ == rate and n_ == name and v_ == "ring")
            ratios = [a["ms_per_iter_median"] / b["ms_per_iter_median"] for a, b in zip(rs, ring)]
            saved = statistics.median(b["ms_per_iter_median"] - a["ms_per_iter_median"] for a, b in zip(rs, ring))
            s = summary_cp(rs)
            print(f"| {rate:.1f} | {name} | {variant} | {s['ms']:.0f} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | {saved:.0f} | {s['cp_comm_ms']:.0f} "
                  f"| {' / '.join(map(str, s['link_payload_mb']))} | {s['cp_counted_mb_rank0']} |")
        return
    print("| inter Mbit/s per rank | case | step ms on / off | paired step ratio | tp comm ms on / off "
          "| share of tp comm hidden, per run | input-gradient sums exposed ms on / off | weight halves ms "
          "| hideable share | link payload MB per host |")
    print("| ---: | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rate, name, _, rs in table:
        med = lambda key, sub: statistics.median(r[key][sub] for r in rs)      # noqa: E731
        payload = [round(statistics.median(r["host_link_payload_bytes_per_iter"][h] for r in rs) / 1e6, 3)
                   for h in range(len(rs[0]["host_link_payload_bytes_per_iter"]))]
        print(f"| {rate:.1f} | {name} | {med('ms_per_step_median', 'overlap'):.0f} / "
              f"{med('ms_per_step_median', 'no_overlap'):.0f} "
              f"| {statistics.median(r['median_of_paired_step_ratios'] for r in rs):.3f} "
              f"| {med('tp_comm_ms_per_step', 'overlap'):.0f} / {med('tp_comm_ms_per_step', 'no_overlap'):.0f} "
              f"| {', '.join(str(r['share_of_tp_comm_hidden']) for r in rs)} "
              f"| {med('input_grad_exposed_ms_per_step', 'overlap'):.0f} / "
              f"{med('input_grad_exposed_ms_per_step', 'no_overlap'):.0f} "
              f"| {median_of('weight_half_ms_per_step', rs):.0f} | {median_of('hideable_share_of_tp_comm', rs):.3f} "
              f"| {' / '.join(map(str, payload))} |")

if __name__ == "__main__":
    main()
