"""Training-step throughput on any mesh, as one JSON object (docs/architecture.md, "Yardsticks").

    python benchmarks/benchmark.py                                   # one process
    mpiexec -n 2 python benchmarks/benchmark.py --tensor-parallel-size 2

Every rank first times float32 sgemm on its one BLAS thread, all ranks at once, so
the peak reflects the contention they will train under. Then it trains on random
tokens (no data files), with a barrier before each step; an iteration's time is the
slowest rank's. MPI time is what the library's `CommStats` counts: the seconds inside
blocking calls and waiting for non-blocking ones, so `comm_fraction` includes time
spent waiting for a peer (a pipeline stage blocked in Recv during the bubble) and
excludes a gradient all-reduce that the backward hid. The flags are the training
script's (numpitron/cli.py), plus --warmup, --iters, --glibc-malloc-defaults and
--cluster-prefix (on the simulated cluster: also count the bytes each host's link sent
during the timed steps, read by rank 0 from the cluster's switch).
"""

import json
import os
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

# One BLAS thread per rank and glibc keeping freed memory: must precede `import numpy`.
configure_process(sys.argv, tune_malloc="--glibc-malloc-defaults" not in sys.argv)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from numpitron.cli import setup_training, training_parser  # noqa: E402
from numpitron.config import ModelConfig  # noqa: E402
from numpitron.optim.memory_report import memory_bytes  # noqa: E402
from numpitron.pipeline_parallel.schedules import closed_form_bubble  # noqa: E402
from numpitron import build  # noqa: E402
from numpitron.blas.products import gemm_of  # noqa: E402
from numpitron.blas.setting import BlasSetting  # noqa: E402

VOCAB, N_TOKENS = 65, 200_000


def parse_args(argv=None):
    p = training_parser(__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--glibc-malloc-defaults", action="store_true",
                   help="skip the library's malloc tuning (numpitron/runtime.py), to measure what it buys")
    p.add_argument("--cluster-prefix", default=None,
                   help="running on the simulated cluster with this prefix: report each host link's bytes")
    return p.parse_args(argv)


class HostLinks:
    """The bytes and frames each host of the simulated cluster sent to the others
    (numpitron/cluster/network.py `link_counters`) between `start` and `stop`, read on
    rank 0 only. Both calls end a barrier and let the last acknowledgements arrive, so
    the window holds exactly the steps between them."""

    def __init__(self, prefix, world):
        self.prefix, self.world, self.before = prefix, world, None

    def _read(self):
        from numpitron.cluster import control, network
        self.world.Barrier()
        time.sleep(0.3)
        if self.world.Get_rank() != 0:
            return None
        spec = control.require(self.prefix)
        return [network.link_counters(spec, h) for h in range(spec.hosts)]

    def start(self):
        if self.prefix:
            self.before = self._read()

    def stop(self, steps: int) -> dict:
        """Per step and host: bytes sent, frames sent, and bytes less the frames' headers."""
        if not self.prefix:
            return {}
        after = self._read()
        if after is None:
            return {}
        from numpitron.cluster.network import FRAME_HEADER_BYTES
        sent = [(a["tx_bytes"] - b["tx_bytes"], a["tx_packets"] - b["tx_packets"]) for a, b in zip(after, self.before)]
        return {"host_link_tx_bytes_per_iter": [round(n / steps) for n, _ in sent],
                "host_link_tx_frames_per_iter": [round(f / steps) for _, f in sent],
                "host_link_payload_bytes_per_iter": [round((n - FRAME_HEADER_BYTES * f) / steps) for n, f in sent]}


def sgemm_gflops(m: int, k: int, n: int, dtype, reps: int, matmul=np.matmul) -> float:
    """Median GFLOP/s of (m, k) @ (k, n) on this rank's BLAS thread(s), with `out=`
    (sgemm in float32, dgemm with --dtype float64: the peak is in the training dtype),
    by the BLAS the run's products take (--blas: its own ceiling, blas/products.py)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    out = np.empty((m, n), dtype)
    matmul(a, b, out=out)                                      # warm the caches and BLAS
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        matmul(a, b, out=out)
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / np.median(times) / 1e9


def cpu_jiffies():
    """(busy, total) CPU time of the whole machine from /proc/stat, in seconds; None
    off Linux. Busy time not spent by our ranks is another job's: it skews the run."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, sum(ticks) / hz      # idle, iowait


def flops_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """PaLM (Chowdhery et al. 2022, appendix B): 6N + 12 L H Q T per token.

    N counts the parameters whose use costs a multiply-add per token: every block
    parameter, the final LayerNorm, and the tied LM head's V x C matmul (the head
    shares its weight with the token embedding, but its matmul is real work). The
    token and position embeddings are lookups, not matmuls, and are left out.
    The attention term 12 L H Q T = 12 L C T counts the full T x T score and
    attention-value matmuls (forward and backward), as PaLM does, not the causal half.
    A mixture-of-experts block counts its active parameters: the router and k experts.
    """
    C, L, T, V = cfg.d_model, cfg.n_layers, cfg.seq_len, cfg.vocab_size
    attention, mlp = (C * 3 * C + 3 * C) + (C * C + C) + 4 * C, (C * 4 * C + 4 * C) + (4 * C * C + C)
    moe_blocks = sum(cfg.is_moe_block(i) for i in range(L))
    n = L * (attention + mlp) + moe_blocks * ((cfg.moe_top_k - 1) * mlp + C * cfg.num_experts) + 2 * C + V * C
    return n, 6 * n + 12 * L * C * T


def trainer_from_args(args):
    model_cfg, parallel_cfg, train_cfg, topo = setup_training(args)
    model_cfg = replace(model_cfg, vocab_size=VOCAB)
    train_cfg = replace(train_cfg, max_iters=args.warmup + args.iters, warmup_iters=0)
    return build.build_trainer(model_cfg, parallel_cfg, train_cfg, topo)


def timed_steps(trainer, tokens, iters: int, world) -> dict:
    """This rank's measurements over `iters` steps, each started by a barrier."""
    step_s, mpi_s, bubbles = [], [], []
    trainer.topo.stats.reset()
    world.Barrier()
    cpu0, faults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(iters):
        world.Barrier()                        # every rank starts the step together
        comm_s = trainer.topo.stats.total_seconds()
        start = time.perf_counter()
        trainer.train_step(tokens)
        step_s.append(time.perf_counter() - start)
        mpi_s.append(trainer.topo.stats.total_seconds() - comm_s)
        stats = trainer.last_pipeline_stats
        bubbles.append((stats.busy_s, stats.wall_s))
    return {"step_s": step_s, "comm_fraction": sum(mpi_s) / sum(step_s), "bubbles": bubbles,
            "own_cpu_s": time.process_time() - cpu0,
            # Minor page faults: memory glibc gave back to the OS and a later step touched again.
            "page_faults_per_iter": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / iters,
            "comm_bytes_per_iter": trainer.topo.stats.total_bytes() / iters,
            "comm_seconds_per_iter_by_kind": {k: v["seconds"] / iters for k, v in trainer.topo.stats.snapshot().items()},
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,     # Linux: KiB
            "optimizer_state_bytes": sum(o.adam.state_nbytes for o in trainer.optimizers),
            "memory_bytes": memory_bytes(trainer.optimizer),
            "peak_activation_bytes": trainer.last_pipeline_stats.peak_activation_bytes,
            "peak_in_flight": trainer.last_pipeline_stats.peak_in_flight}


def main():
    args = parse_args()
    world = MPI.COMM_WORLD
    loadavg, baseline_rss_kb = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The peak: all ranks at once on their own thread. 768 x 128 @ 128 x 512 is the
    # default model's MLP up-projection (N = B*T = 768); 1024^3 is the BLAS ceiling.
    blas = BlasSetting(args.blas)
    blas.check_blas()
    matmul = gemm_of(blas.resolved_blas())
    world.Barrier()
    gflops_small = sgemm_gflops(768, 128, 512, np.dtype(args.dtype), reps=50, matmul=matmul)
    world.Barrier()
    gflops_large = sgemm_gflops(1024, 1024, 1024, np.dtype(args.dtype), reps=20, matmul=matmul)
    gemm = world.gather((gflops_small, gflops_large), root=0)

    trainer = trainer_from_args(args)
    topo = trainer.topo
    # Same seed on every rank: every rank must see the same token stream.
    tokens = np.random.default_rng(0).integers(0, VOCAB, N_TOKENS).astype(np.uint16)
    for _ in range(args.warmup):
        trainer.train_step(tokens)
    links = HostLinks(args.cluster_prefix, world)
    links.start()
    machine0 = cpu_jiffies() if world.Get_rank() == 0 else None
    window = time.perf_counter()
    mine = timed_steps(trainer, tokens, args.iters, world)
    world.Barrier()
    window = time.perf_counter() - window          # every step, DiLoCo's rare exchanges too, and the barriers
    machine1 = cpu_jiffies() if world.Get_rank() == 0 else None
    link_bytes = links.stop(args.iters)
    # The iteration time is the slowest rank's: reduce per-step times with MAX.
    slowest = np.array(mine.pop("step_s"))
    world.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    ranks = world.gather(mine, root=0)
    if world.Get_rank() != 0:
        return

    n_ranks, tokens_per_iter = world.Get_size(), trainer.global_batch_size * args.seq_len
    ms = float(np.median(slowest)) * 1e3
    n_params, flops_tok = flops_per_token(trainer.model_cfg)
    achieved = flops_tok * tokens_per_iter / (ms / 1e3) / 1e9
    peak_per_rank = float(np.mean([large for _, large in gemm]))
    snapshot = topo.stats.snapshot()
    result = {
        "mesh": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "ep": topo.ep, "world": n_ranks,
                 "cp": topo.cp, "schedule": args.pipeline_schedule if topo.pp > 1 else None, "zero_stage": args.zero_stage,
                 "overlap_grad_reduce": args.overlap_grad_reduce, "bucket_size": args.bucket_size,
                 "micro_batch": args.micro_batch_size, "global_batch": trainer.global_batch_size,
                 "num_microbatches": trainer.num_microbatches},
        "model": {"n_layers": args.n_layers, "n_heads": args.n_heads, "d_model": args.d_model,
                  "seq_len": args.seq_len, "vocab": VOCAB, "flops_params": n_params,
                  "num_experts": args.num_experts, "moe_top_k": args.moe_top_k},
        "blas": trainer.blas,           # which library and kernel ran the products (blas/products.py)
        "dtype": args.dtype, "iters": args.iters, "glibc_malloc_defaults": args.glibc_malloc_defaults,
        "env": {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "MPIR_CVAR_ENABLE_HEAVY_YIELD")},
        # On a shared machine another job's load skews every figure: record it.
        "loadavg_1min_at_start": round(loadavg, 2),
        "tokens_per_iter": tokens_per_iter,
        "ms_per_iter_median": round(ms, 2),
        "ms_per_iter_min": round(float(slowest.min()) * 1e3, 2),
        "ms_per_iter_window": round(window * 1e3 / args.iters, 2),
        "tokens_per_s": round(tokens_per_iter / (ms / 1e3), 1),
        "flops_per_token": flops_tok,
        "achieved_gflops": round(achieved, 2),
        "sgemm_gflops_per_rank": {"768x128x512": [round(s, 1) for s, _ in gemm],
                                  "1024^3": [round(large, 1) for _, large in gemm]},
        "peak_gflops_per_rank": round(peak_per_rank, 1),
        "peak_gflops_total": round(peak_per_rank * n_ranks, 1),
        "mfu": round(achieved / (peak_per_rank * n_ranks), 4),
        "comm_bytes_per_iter": ranks[0]["comm_bytes_per_iter"],
        "comm_bytes_per_iter_by_kind": {k: v["bytes"] / args.iters for k, v in snapshot.items()},
        "comm_calls_per_iter_by_kind": {k: v["calls"] / args.iters for k, v in snapshot.items()},
        "comm_bytes_per_iter_per_rank": [r["comm_bytes_per_iter"] for r in ranks],
        "comm_seconds_per_iter_by_kind_per_rank": [{k: round(v, 6) for k, v in r["comm_seconds_per_iter_by_kind"].items()}
                                                   for r in ranks],
        "comm_fraction": round(float(np.mean([r["comm_fraction"] for r in ranks])), 4),
        "comm_fraction_per_rank": [round(r["comm_fraction"], 4) for r in ranks],
        # expert parallelism's all-to-alls (counts and tokens), as a share of the step
        "all_to_all_fraction": round(float(np.mean([sum(v for k, v in r["comm_seconds_per_iter_by_kind"].items()
                                                        if k.startswith("ep.")) for r in ranks])) / (ms / 1e3), 4),
        "peak_rss_mb": round(max(r["peak_rss_kb"] for r in ranks) / 1024, 1),
        "baseline_rss_mb_rank0": round(baseline_rss_kb / 1024, 1),
        "optimizer_state_bytes_per_rank": [r["optimizer_state_bytes"] for r in ranks],
        # parameters, gradients, optimizer state, and the peaks of ZeRO's gathered layers
        # and whole gradients during a pass (docs/09-zero-2-and-3.md)
        "memory_bytes_per_rank": [r["memory_bytes"] for r in ranks],
        "peak_activation_bytes_per_rank": [r["peak_activation_bytes"] for r in ranks],
        "page_faults_per_iter_per_rank": [round(r["page_faults_per_iter"]) for r in ranks],
        **link_bytes,
    }
    if machine0 and machine1 and machine1[1] > machine0[1]:
        busy, total = machine1[0] - machine0[0], machine1[1] - machine0[1]
        result["foreign_cpu_share"] = round(max(0.0, busy - sum(r["own_cpu_s"] for r in ranks)) / total, 3)
    if topo.pp > 1:
        # Bubble of one iteration: idle share of all stages' schedule time (the
        # optimizer step is outside it), i.e. 1 - sum(busy) / sum(wall) over stages.
        per_iter = [1 - sum(r["bubbles"][i][0] for r in ranks) / sum(r["bubbles"][i][1] for r in ranks)
                    for i in range(args.iters)]
        P, m, parallel = topo.pp, trainer.num_microbatches, trainer.parallel_cfg
        result["pipeline_schedule"] = f"{parallel.schedule} v={parallel.virtual_stages}"
        result["pipeline_bubble_measured_median"] = round(float(np.median(per_iter)), 4)
        formula = closed_form_bubble(parallel.schedule, P, m, parallel.virtual_stages)
        result["pipeline_bubble_formula"] = round(formula, 4)
        result["peak_in_flight_per_rank"] = [r["peak_in_flight"] for r in ranks]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    from numpitron.distributed.launch import run_main
    sys.exit(run_main(lambda argv: main()))
