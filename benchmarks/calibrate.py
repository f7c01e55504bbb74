"""Measure this machine for the planner and write numpitron/plan/profiles/this-machine.json.

    mpiexec -n 2 python benchmarks/calibrate.py

Per rank, all ranks at once and one BLAS thread each (so that the figures carry the
contention the ranks train under), medians of repeated runs:

* the matmul curve: float32 sgemm of s x s by s x s for s from 16 to 1024 (batched, so
  that a small s makes many calls), filed under the FLOPs of one call, 2 s^3; 1024^3's
  rate is the peak;
* the element-wise bandwidth: the median time per element of the four kinds of NumPy
  kernel the layers run (c = a * b, a += b, a sum along rows, a subtraction broadcast
  along rows) on 2^18 float32 elements, an activation's size (the default model's
  residual stream is 0.4 MB, its MLP hidden layer 1.5 MB), counted as 3 x 4 bytes;
* the exponential: np.exp's time per element on the same array;
* the call: a tiny model's training step (d_model 8, 8 tokens, one sequence: every
  array a few elements, so the step is all interpreter) divided by the NumPy calls
  numpitron/plan/kernels.py counts for it, so that the Python around each counted
  call is in its price;
* the cores this process may run on (os.sched_getaffinity): ranks beyond them
  time-share; and what each blocking collective costs then (time_sharing_wait): rank 0
  launches twice as many ranks as cores (--time-sharing), in pairs that compute
  matmuls and all-reduce 384 KiB (an activation of the default model), and times that
  loop against the matmuls alone;
* the slowest rank: every rank repeats the same few milliseconds of work between
  barriers; the slowest rank's median time over a rank's own median (slowest_rank),
  the pace at which ranks that wait for each other go;

and between two ranks the latency (an 8-byte all-reduce) and bandwidth (a 16 MiB
send) of MPI. Each figure is the median of five rounds taken in turn.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process, usable_cores  # noqa: E402

configure_process(sys.argv)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.plan.accounting import Rank  # noqa: E402
from numpitron.plan.devices import PROFILES_DIR  # noqa: E402
from numpitron.plan.predict import microbatch_work, step_work  # noqa: E402
from numpitron.build import build_trainer  # noqa: E402

SIDES = (16, 32, 64, 128, 256, 512, 1024)
ELEMENTS = 1 << 18
ROUNDS = 5


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def sgemm(s: int, world) -> float:
    """FLOP/s of a batch of s x s matmuls, 2^21 multiply-adds or more in all."""
    rng, batch = np.random.default_rng(0), max(1, (128 // s) ** 3)
    a, b = (rng.standard_normal((batch, s, s)).astype(np.float32) for _ in range(2))
    out = np.empty((batch, s, s), np.float32)
    world.Barrier()
    return 2 * batch * s ** 3 / median_s(lambda: np.matmul(a, b, out=out), 20 if s >= 512 else 100)


def elementwise(world) -> tuple[float, float]:
    """(seconds per element of a typical pass, of np.exp)."""
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal(ELEMENTS).astype(np.float32) for _ in range(2))
    z = np.empty_like(x)
    rows, out_rows = x.reshape(-1, 128), z.reshape(-1, 128)
    kernels = [lambda: np.multiply(x, y, out=z), lambda: np.add(z, y, out=z), lambda: rows.sum(axis=-1),
               lambda: np.subtract(rows, rows[:, :1], out=out_rows)]
    world.Barrier()
    per_pass = float(np.median([median_s(k, 50) for k in kernels])) / ELEMENTS
    return per_pass, median_s(lambda: np.exp(x, out=z), 50) / ELEMENTS


def call_time(world) -> float:
    """Seconds per counted NumPy call: a tiny model's step over the calls the planner
    counts for it (one micro-batch and one optimizer step on one process)."""
    model = ModelConfig(d_model=8, n_heads=2, seq_len=8, n_layers=4)
    parallel, train = ParallelConfig(), TrainConfig(micro_batch_size=1, global_batch_size=1, warmup_iters=0)
    trainer = build_trainer(model, parallel, train, Topology.serial())
    tokens = np.random.default_rng(2).integers(0, model.vocab_size, 4096).astype(np.uint16)
    world.Barrier()
    step = median_s(lambda: trainer.train_step(tokens), 200)
    rank = Rank(1, 1, 1, 1)
    return step / (microbatch_work(model, parallel, train, rank).calls + step_work(model, parallel, rank).calls)


def time_sharing_wait(world, elements: int = 98304) -> float:
    """Run with more ranks than cores: seconds a pair all-reduce of `elements` float32
    adds between matmuls."""
    pair = world.Split(world.rank // 2, world.rank)
    a = np.random.default_rng(3).standard_normal((256, 256)).astype(np.float32)
    out, small, reps = np.empty_like(a), np.zeros(elements, np.float32), 40

    def loop(sync):
        world.Barrier()
        start = time.perf_counter()
        for _ in range(reps):
            for _ in range(8):
                np.matmul(a, a, out=out)
            if sync:
                pair.Allreduce(MPI.IN_PLACE, small)
        return time.perf_counter() - start
    alone = min(loop(False) for _ in range(3))
    synced = min(loop(True) for _ in range(3))
    return max(0.0, float(np.median(world.allgather((synced - alone) / reps))))


def slowest_rank(world) -> float:
    """A synchronous step goes at the pace of its slowest rank. Every rank repeats the
    same few milliseconds of work (the default model's MLP up-projection and a GELU's
    worth of passes) between barriers, 400 times (a few seconds); the figure is the median
    over repetitions of the slowest rank's time, over the median of each rank's own."""
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((768, 128)).astype(np.float32), rng.standard_normal((128, 512)).astype(np.float32)
    h = np.empty((768, 512), np.float32)

    def work():
        for _ in range(4):
            np.matmul(x, w, out=h)
            for _ in range(8):
                np.multiply(h, 0.5, out=h)
    own = []
    for _ in range(400):
        world.Barrier()
        start = time.perf_counter()
        work()
        own.append(time.perf_counter() - start)
    slowest = np.array(own)
    world.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    ratio = float(np.median(slowest) / np.median(own))
    return float(np.median(world.allgather(ratio)))


def launch_time_sharing(cores: int) -> float:
    """This script on 2 x cores ranks (a fresh launch: the variables of ours removed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_LOCAL", "OMPI_", "PMIX_"))}
    bin_dir = Path(sys.executable).parent
    mpiexec = bin_dir / "mpiexec" if (bin_dir / "mpiexec").exists() else "mpiexec"
    try:
        out = subprocess.run([str(mpiexec), "-n", str(2 * cores), sys.executable, __file__, "--time-sharing"],
                             env=env, capture_output=True, text=True, timeout=300, check=True).stdout
        return float(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as error:
        print(f"time-sharing wait not measured ({error}); 0 written", file=sys.stderr)
        return 0.0


def main():
    world = MPI.COMM_WORLD
    if "--time-sharing" in sys.argv:       # [--pair-elements N]: benchmarks/cluster_layouts.py's 2 (8 bytes)
        at = sys.argv.index("--pair-elements") + 1 if "--pair-elements" in sys.argv else 0
        wait = time_sharing_wait(world, int(sys.argv[at]) if at else 98304)
        if world.rank == 0:
            print(wait)
        return
    rounds = []
    for _ in range(ROUNDS):               # the machine drifts: rounds in turn, then medians
        rounds.append(([sgemm(s, world) for s in SIDES], *elementwise(world)))
    curve = [(2 * s ** 3, float(np.median([r[0][i] for r in rounds]))) for i, s in enumerate(SIDES)]
    per_pass, exp = (float(np.median([r[i] for r in rounds])) for i in (1, 2))
    call = call_time(world)
    pace = slowest_rank(world) if world.Get_size() >= 2 else 1.0
    latency = bw = None
    if world.Get_size() >= 2:
        tiny = np.zeros(1)
        world.Barrier()
        latency = median_s(lambda: world.Allreduce(MPI.IN_PLACE, tiny), 200) / 2
        big = np.zeros(4 << 20, np.float32)

        def ping():
            if world.rank == 0:
                world.Send(big, dest=1)
                world.Recv(big, source=1)
            elif world.rank == 1:
                world.Recv(big, source=0)
                world.Send(big, dest=0)
        world.Barrier()
        bw = 2 * big.nbytes / median_s(ping, 10)
    mine = {"curve": curve, "pass": per_pass, "exp": exp, "call": call}
    everyone = world.gather(mine, root=0)
    if world.rank != 0:
        return

    def median(key):
        return float(np.median([r[key] for r in everyone]))
    curve = [(s, float(np.median([r["curve"][i][1] for r in everyone]))) for i, (s, _) in enumerate(curve)]
    cores = usable_cores()
    profile = {"name": "this-machine", "peak_flops": curve[-1][1],
               "memory_bandwidth": 3 * 4 / median("pass"),
               "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
               "devices_per_node": cores,
               "intra_latency": latency or 4e-6, "intra_bandwidth": bw or 6e9,
               "inter_latency": latency or 4e-6, "inter_bandwidth": bw or 6e9, "bytes_per_parameter": 0,
               "matmul_curve": curve, "exp_time": median("exp"), "call_time": median("call"),
               "cores_per_node": cores, "time_sharing_wait": launch_time_sharing(cores), "slowest_rank": pace}
    PROFILES_DIR.mkdir(exist_ok=True)
    (PROFILES_DIR / "this-machine.json").write_text(json.dumps(profile, indent=1) + "\n")
    print(json.dumps(profile))


if __name__ == "__main__":
    main()
