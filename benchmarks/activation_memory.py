"""Activation memory and step time with sequence parallelism and recomputation, on
tp ranks (run with mpiexec -n 2): one Markdown table row per (sp, recompute).

    mpiexec -n 2 python benchmarks/activation_memory.py --seq-len 512 --micro-batch-size 4

Bytes per block are measured (`cache_nbytes` of a block's real cache) and printed
beside the formula of numpitron/transformer/activation_memory.py; the step time is the median
of --iters training steps (float32, one BLAS thread per rank).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.transformer.activation_memory import block_activation_bytes  # noqa: E402
from numpitron.nn.cache_bytes import cache_nbytes  # noqa: E402
from numpitron.build import build_trainer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--seq-len", 64), ("--micro-batch-size", 12), ("--iters", 10), ("--d-model", 128),
                          ("--n-heads", 4), ("--n-layers", 4)):
        p.add_argument(flag, type=int, default=default)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    topo = Topology.from_world(tensor=world.Get_size())
    model_cfg = ModelConfig(seq_len=args.seq_len, d_model=args.d_model, n_heads=args.n_heads,
                            n_layers=args.n_layers).validate()
    train_cfg = TrainConfig(micro_batch_size=args.micro_batch_size, warmup_iters=0).validate()
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, 200_000).astype(np.uint16)
    if world.Get_rank() == 0:
        print(f"| tp | sp | recompute | bytes per block (measured) | formula | step ms (median of {args.iters}) |")
        print("| ---: | --- | --- | ---: | ---: | ---: |")
    for sp in (False, True):
        for recompute in ("none", "selective", "full"):
            parallel = ParallelConfig(sequence_parallel=sp and topo.tp > 1, recompute=recompute).validate()
            trainer = build_trainer(model_cfg, parallel, train_cfg, topo)
            ids, targets = trainer.microbatches(tokens, "train", 0)[0]
            measured = cache_nbytes(trainer.model.forward(ids, targets)[1][1])
            formula = block_activation_bytes(args.micro_batch_size, args.seq_len, args.d_model, args.n_heads,
                                             topo.tp, parallel.sequence_parallel, recompute, itemsize=4)
            times = []
            for _ in range(args.iters + 2):
                world.Barrier()
                start = time.perf_counter()
                trainer.train_step(tokens)
                times.append(time.perf_counter() - start)
            ms = world.allreduce(float(np.median(times[2:])) * 1e3, op=MPI.MAX)
            if world.Get_rank() == 0:
                print(f"| {topo.tp} | {'on' if parallel.sequence_parallel else 'off'} | {recompute} | "
                      f"{measured / 2**20:.2f} MiB | {formula / 2**20:.2f} MiB | {ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
