"""The planner's side of the layouts measured on the scaled cluster
(benchmarks/cluster_layouts.py): a measured row's predicted step, planned with the tiers
its sweeps fitted, the wait for a peer to be scheduled that the cluster measured, and
the compute speed the run's own ranks measured."""

from dataclasses import replace

PAIR_ELEMENTS = 2                 # an 8-byte all-reduce: its time on a link is 2 alpha, the rest is waiting


def sync_wait(row: dict) -> float:
    """The wait a blocking collective adds for a peer to be scheduled on this cluster
    (the planner's time_sharing_wait): what the pair's 8-byte all-reduce added, less its
    time on the pair's tier, 2 alpha + x / beta (devices.fit_link with n = 2)."""
    tier = "intra" if row["per_host"] > 1 else "inter"
    transfer = 2 * row[f"alpha_{tier}_s"] + 4 * PAIR_ELEMENTS / row[f"beta_{tier}_bytes_s"]
    return max(0.0, row["pair_all_reduce_added_s"] - transfer)


def plan_step(flags: list, device) -> dict:
    """The planner's result for these training flags on 4 ranks (raises UserError when
    the layout cannot work, with the line training would print)."""
    from numpitron.cli import configs_from_args
    from numpitron.plan.__main__ import layout_of, parser
    from numpitron.plan.predict import plan
    args = parser().parse_args(flags)
    model, parallel, train = configs_from_args(args)
    return plan(model, parallel, train, layout_of(args, 4, model, parallel, train), device)


def at_speed(device, measured: dict):
    """The profile at the compute speed the run's own ranks measured just before it
    trained (benchmark.py: 1024^3 sgemm on every rank at once): every figure of the
    CPU's work scaled by that rate over the profile's peak. A rank's rate is measured
    sharing its core as in training, and the planner divides by the sharing itself, so
    it is multiplied back by it first. The wait for a peer to be scheduled stays as
    calibrated: under load it is in the fitted alpha already."""
    speed = measured["peak_gflops_per_rank"] * 1e9 * device.time_sharing(4) / device.peak_flops
    return replace(device, peak_flops=device.peak_flops * speed, memory_bandwidth=device.memory_bandwidth * speed,
                   matmul_curve=tuple((size, rate * speed) for size, rate in device.matmul_curve),
                   exp_time=device.exp_time / speed, call_time=device.call_time / speed), speed


def predict(row: dict, cpu):
    """The planner's step for a measured row (kept in it: predicted_ms, speed, crosses):
    each tier at the alpha and beta its sweep fitted (one rank's card of the inter-host
    link, which a token bucket lets run a little above its rate after a pause, as it
    does between a step's messages); the wait for a peer to be scheduled as the cluster
    measured it (sync_wait); the compute speed the run measured."""
    device = replace(cpu, ranks_per_host=row["per_host"], intra_latency=row["alpha_intra_s"],
                     time_sharing_wait=sync_wait(row) if "pair_all_reduce_added_s" in row else cpu.time_sharing_wait,
                     inter_latency=row["alpha_inter_s"], inter_bandwidth=row["beta_inter_bytes_s"],
                     intra_bandwidth=row["beta_intra_bytes_s"])
    scaled, speed = at_speed(device, {"peak_gflops_per_rank": row["sgemm_gflops_per_rank"]})
    planned = plan_step(row["flags"], scaled)
    row.update(predicted_ms=1e3 * planned["step_s"], speed=speed, crosses=planned["groups_across_hosts"])
    return planned
