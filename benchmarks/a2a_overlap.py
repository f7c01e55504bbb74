"""The experts' all-to-all time that pairing a forward and a backward chunk hides
(chunk_pairing/, docs/11-pipeline-schedules.md and docs/13-experts.md), measured on the
simulated cluster beside the planner. Needs root (the cluster's namespaces).

    python benchmarks/a2a_overlap.py                          # the scaled InfiniBand rate and a quarter of it
    python benchmarks/a2a_overlap.py --layout pp1 --rates 1 --iters 2 --warmup 1 --traced 1    # a smoke run
    python benchmarks/a2a_overlap.py --layout pp1 --moe-expert-hidden 4096 --predict-only    # the planner only
    mpiexec -n 4 python benchmarks/a2a_overlap_worker.py --pipeline-parallel-size 2 \\
        --data-parallel-size 2 --expert-parallel-size 2 --num-experts 4 ...        # one node, no cluster

Every block a mixture of 4 experts (top 2, one shared), dp = ep = 2, on one of two
layouts (--layout). pp2: pp = 2 (DualPipeV) on 4 ranks, which share the machine's 2
cores in pairs. pp1: pp = 1 on 2 ranks, a core each: 1F1B, whose every backward pairs
with the next micro-batch's forward (Megatron's combined 1F1B), each pair free of the
wait for a second stage's input. The mesh puts pp outermost (distributed/topology.py),
so on hosts of two ranks an ep pair of pp2 would share a host: by default every rank has
a host of its own (--hosts-of 1), and the experts' all-to-alls cross the inter-host
link. The links are benchmarks/cluster_layouts.py's: A100 links scaled by this CPU's
FLOP/s over the A100's.

At each rate one run (a2a_overlap_worker.py) takes paired steps (--moe-a2a-overlap),
unpaired ones (what --no-moe-a2a-overlap builds: every all-to-all blocking) and
layer-only ones (each MoE layer's own filler, no pair) in turn, so the CPU's drift
falls on all three. Each kind gives: the step time (the slowest rank's
median); the seconds the ranks waited in the experts' all-to-alls (CommStats); and, from
a trace of paired steps (trace/comm_probe.py's wrappers), each all-to-all's time in
flight and the part the rank did not wait for (hidden). The hidden share is measured twice: from the step times,
(unpaired - paired) / unpaired all-to-all wait, and from the paired trace, hidden /
in flight. The planner's share, with the tiers fitted on the cluster
(cluster_layouts.link_fit) and the compute speed the run measured: hidden /
all-to-all time of plan/a2a_overlap.py. Each figure is a median of --iters steps of its
kind, and --rounds repeats the whole (a cluster run each) to read the noise band.

What can be hidden at all: a step is no shorter than the bytes its rank sends across
hosts take at the fitted beta (the link's time), so of the unpaired step's all-to-all
wait A at most (unpaired step - link's time) / A can be hidden, by any pairing (the
rows' "bound"). Per token and MoE block a rank sends k (1 - 1/ep) rows of d floats in
each of its four all-to-alls (dispatch, combine and their backwards), 16 d bytes here,
and computes 12 (k + s) d H FLOPs in the experts (H their hidden width, s shared) and
24 d^2 + 12 T d in attention; dp's all-reduce moves attention's and the shared experts'
4 d^2 + 2 s d H elements a block once a step, whatever the tokens. Wide experts add
compute at no all-to-all cost; a wide d adds both, and all-reduce bytes as d^2. The
shape flags (--d-model, --moe-expert-hidden, --seq-len, --n-layers, --micro-batch-size,
--microbatches) choose the model, and --predict-only prints the planner's share and the
bound for it, on a given fit and speed, without the cluster.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]        # the ranks (a2a_overlap_worker.py) configure their own process

SHAPE = {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 64, "moe_expert_hidden": 0,
         "micro_batch_size": 4, "microbatches": 8}     # the default; --d-model etc. change it
EXPERTS = ["--num-experts", "4", "--moe-top-k", "2", "--moe-shared-experts", "1"]
LAYOUTS = {                    # name: (mesh, ranks)
    "pp2": (["--pipeline-parallel-size", "2", "--data-parallel-size", "2", "--expert-parallel-size", "2",
             "--pipeline-schedule", "dualpipev"], 4),
    "pp1": (["--pipeline-parallel-size", "1", "--data-parallel-size", "2", "--expert-parallel-size", "2",
             "--pipeline-schedule", "1f1b"], 2),
}
DP = 2                                  # both layouts' data-parallel size


def model_flags(args) -> list:
    """The training flags of the model and batch --d-model etc. choose (--microbatches: m
    a dp rank; m = 8 gives 7 pairs at pp = 1)."""
    shape = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in SHAPE if name != "microbatches"]
    return [*shape, *EXPERTS, f"--global-batch-size={args.micro_batch_size * args.microbatches * DP}",
            *([] if args.dp_overlap else ["--no-overlap-grad-reduce"])]


def planned(flags: list, device, fits: dict, gflops: float, ranks: int) -> dict:
    """The planner's all-to-all terms per stage, on the fitted tiers at the measured speed
    (cluster_prediction.at_speed and plan_step, for `ranks` rather than their 4), paired and
    unpaired; and the bound. A step cannot be shorter than the bytes its rank sends across
    hosts take at the fitted beta (link_s), so of the unpaired step's all-to-all time A no
    pairing hides more than (unpaired step - link_s) / A."""
    from numpitron.cli import configs_from_args
    from numpitron.plan.__main__ import layout_of, parser
    from numpitron.plan.predict import plan
    tiers = replace(device, ranks_per_host=fits["per_host"], inter_latency=fits["alpha_inter_s"],
                    inter_bandwidth=fits["beta_inter_bytes_s"], intra_latency=fits["alpha_intra_s"],
                    intra_bandwidth=fits["beta_intra_bytes_s"])
    speed = gflops * 1e9 * tiers.time_sharing(ranks) / tiers.peak_flops
    scaled = replace(tiers, peak_flops=tiers.peak_flops * speed, memory_bandwidth=tiers.memory_bandwidth * speed,
                     matmul_curve=tuple((size, rate * speed) for size, rate in tiers.matmul_curve),
                     exp_time=tiers.exp_time / speed, call_time=tiers.call_time / speed)
    results = []
    for overlap in ("--moe-a2a-overlap", "--no-moe-a2a-overlap"):
        args = parser().parse_args(flags + [overlap])
        model, parallel, train = configs_from_args(args)
        results.append(plan(model, parallel, train, layout_of(args, ranks, model, parallel, train), scaled))
    on, off = results
    link_s = [s["tiers"].get("inter", {"bytes": 0.0})["bytes"] / fits["beta_inter_bytes_s"] for s in on["stages"]]
    return {"step_ms": 1e3 * on["step_s"], "unpaired_step_ms": 1e3 * off["step_s"],
            "stages": [{**{k: s["all_to_all"][k] for k in ("all_to_all", "hidden", "pairs")}, "link_s": t,
                        "bound": (off["step_s"] - t) / s["all_to_all"]["all_to_all"]}
                       for s, t in zip(on["stages"], link_s)]}


def at_rate(args, cpu, multiple: float, infiniband: float, intra: float, mesh: list, ranks: int) -> list:
    """Bring the cluster up at `multiple` of the scaled inter-host rate, fit its links, and run --rounds
    rounds of paired and unpaired: a row each."""
    import cluster_layouts as cl
    per_host, rows, inter = args.hosts_of, [], multiple * infiniband
    cl.scaled_cluster(ranks // per_host, per_host, inter, intra, prefix=args.prefix)
    alpha_inter, beta_inter = cl.link_fit(1, args.prefix)
    alpha_intra, beta_intra = cl.link_fit(2, args.prefix) if per_host > 1 else (0.0, intra)
    fits = {"per_host": per_host, "alpha_inter_s": alpha_inter, "beta_inter_bytes_s": beta_inter,
            "alpha_intra_s": alpha_intra, "beta_intra_bytes_s": beta_intra}
    for round_ in range(args.rounds):
        start = time.time()
        out = cl.cluster("run", "-n", str(ranks), "--", sys.executable, str(HERE / "a2a_overlap_worker.py"),
                         "--warmup", str(args.warmup), "--iters", str(args.iters), "--traced", str(args.traced),
                         "--cluster-prefix", args.prefix, *model_flags(args), *mesh, "--moe-a2a-overlap",
                         prefix=args.prefix)
        run = {**json.loads(out.strip().splitlines()[-1]), "wall_s": time.time() - start}
        on, off, layer = run["paired"], run["unpaired"], run["layer-only"]
        waited_off = max(r["waited_s"] for r in off["per_rank"])
        plan = planned(model_flags(args) + mesh, cpu, fits, run["sgemm_gflops_per_rank"], ranks)
        link_s = max(run.get("host_link_payload_bytes_per_iter", [0])) / beta_inter    # the measured bound's floor
        row = {"layout": args.layout, "dp_overlap": args.dp_overlap, "inter_multiple": multiple,
               "inter_mbit_s": 8 * inter / 1e6, "round": round_, **fits,
               "paired_ms": on["ms_median"], "unpaired_ms": off["ms_median"],
               "a2a_waited_unpaired_ms": 1e3 * waited_off,
               "a2a_waited_paired_ms": 1e3 * max(r["waited_s"] for r in on["per_rank"]),
               "hidden_share_from_steps": (off["ms_median"] - on["ms_median"]) / (1e3 * waited_off)
               if waited_off else None,
               "layer_only_ms": layer["ms_median"],            # the shared experts' filler alone, no pair
               "hidden_share_layer_only": (off["ms_median"] - layer["ms_median"]) / (1e3 * waited_off)
               if waited_off else None,
               "hidden_share_from_trace": [r["hidden_s"] / r["in_flight_s"] if r["in_flight_s"] else None
                                           for r in run["paired_trace"]],
               "hidden_share_planned": [s["hidden"] / s["all_to_all"] for s in plan["stages"]],
               "hidden_share_bound": (off["ms_median"] / 1e3 - link_s) / waited_off if waited_off else None,
               "hidden_share_bound_planned": [s["bound"] for s in plan["stages"]],
               "planned_step_ms": plan["step_ms"], "run": run, "planned": plan}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("run", "planned")}), flush=True)
    return rows


def predict(args, cpu, mesh: list, ranks: int) -> None:
    """--predict-only: the planner's figures at each rate for the given link fit and speed,
    without the cluster, to choose a model before measuring it."""
    alpha, beta = (float(x) for x in args.fit.split(","))
    for multiple in (float(r) for r in args.rates.split(",")):
        fits = {"per_host": args.hosts_of, "alpha_inter_s": alpha * 1e-6, "beta_inter_bytes_s": multiple * beta * 1e6,
                "alpha_intra_s": 0.0, "beta_intra_bytes_s": cpu.intra_bandwidth}
        plan = planned(model_flags(args) + mesh, cpu, fits, args.gflops, ranks)
        for i, s in enumerate(plan["stages"]):
            print(f"x{multiple:g}, stage {i}: planned step {plan['step_ms']:.0f} ms paired, "
                  f"{plan['unpaired_step_ms']:.0f} unpaired; all-to-all {1e3 * s['all_to_all']:.0f} ms, "
                  f"{s['pairs']} pairs hide {s['hidden'] / s['all_to_all']:.2f} of it; the link's bytes take "
                  f"{1e3 * s['link_s']:.0f} ms, so at most {s['bound']:.2f} can be hidden")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="pp2", choices=sorted(LAYOUTS), help="pp2: DualPipeV on 4 ranks; pp1: "
                   "combined 1F1B on 2 ranks, a core each")
    p.add_argument("--rates", default="1,0.25", help="inter-host rates, multiples of the scaled InfiniBand")
    p.add_argument("--hosts-of", type=int, default=1, choices=(1, 2), help="ranks per host (1: ep crosses hosts)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--traced", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prefix", default="npt-a2a-")
    p.add_argument("--out", default=None, help="write every row to this JSON")
    for name, value in SHAPE.items():               # the model's shape: training's flags, but --microbatches
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                       help="micro-batches a dp rank" if name == "microbatches" else None)
    p.add_argument("--dp-overlap", action="store_true", help="reduce dp's gradients during the last backward "
                   "(default: after it, so the all-to-alls never queue behind a bucket)")
    p.add_argument("--predict-only", action="store_true", help="print the planner's share and the bound, no cluster")
    p.add_argument("--fit", default="77,8.29", help="with --predict-only: the inter-host alpha (us) and beta (MB/s "
                   "a rank) at the scaled rate, as fitted on the cluster (benchmarks/README.md)")
    p.add_argument("--gflops", type=float, default=95.0, help="with --predict-only: each rank's sgemm GFLOP/s, "
                   "as the run measures it (88 to 101 in the pp1 runs)")
    args = p.parse_args()
    from numpitron.plan.devices import load_device
    cpu = load_device("this-machine")
    if args.predict_only:
        return predict(args, cpu, *LAYOUTS[args.layout])
    import cluster_layouts as cl
    intra, infiniband = cl.scaled_rates(cpu.peak_flops)
    rows, (mesh, ranks) = [], LAYOUTS[args.layout]
    if ranks // args.hosts_of < 2:
        p.error(f"--layout {args.layout}: {ranks} ranks on hosts of {args.hosts_of} leave the experts on one host")
    try:                          # the cluster comes down however the run ends (Ctrl-C too)
        for multiple in (float(r) for r in args.rates.split(",")):
            rows += at_rate(args, cpu, multiple, infiniband, intra, mesh, ranks)
    finally:
        cl.cluster("down", prefix=args.prefix, check=False)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        trace = [round(x, 2) for x in r["hidden_share_from_trace"] if x is not None]
        steps, bound = r["hidden_share_from_steps"], r["hidden_share_bound"]
        print(f"{r['inter_mbit_s']:.1f} Mbit/s: paired {r['paired_ms']:.0f} ms, layer-only {r['layer_only_ms']:.0f} ms, "
              f"unpaired {r['unpaired_ms']:.0f} ms; hidden share from steps {steps if steps is None else round(steps, 2)} "
              f"(layer-only {r['hidden_share_layer_only']:.2f}), from the trace (per rank) {trace}, "
              f"planned (per stage) {[round(x, 2) for x in r['hidden_share_planned']]}; at most "
              f"{bound if bound is None else round(bound, 2)} hideable (the link's bytes at the fitted beta)")


if __name__ == "__main__":
    main()
