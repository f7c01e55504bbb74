"""Tokens/s, peak memory and activation memory of each precision on this CPU
(docs/07-numbers.md): the default model, one process, one BLAS thread.

    python benchmarks/precision_speed.py --rounds 7 --steps 3

Speed: each round runs --steps training steps of every format, the order rotated
round by round so a burst of load on a shared machine hits every format alike; a
format's speed is the median over rounds, and its ratio to fp32 the median of the
per-round ratios (paired). Both wall-clock and CPU seconds are given: on a loaded
machine CPU time is the steadier of the two. Peak memory: the largest bytes NumPy held
at once during one step (tracemalloc), the model and its optimizer included.
Activation memory: the bytes the whole model's caches keep for the backward of one
micro-batch, as allocated here, without recomputation (float32 arrays whatever the
format: what the layers cache is not the format's values) and under full recomputation
(a block's input, kept in 2 bytes by bf16 and fp16). Prints one JSON line per format,
then the load.
"""

import argparse
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

import numpy as np  # noqa: E402

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.nn.cache_bytes import cache_nbytes  # noqa: E402
from numpitron.build import build_trainer  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    model_cfg = ModelConfig().validate()
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, 200_000).astype(np.uint16)
    trainers = {name: build_trainer(model_cfg, ParallelConfig().validate(), TrainConfig(precision=name).validate(),
                              Topology.serial()) for name in PRECISIONS}
    step_tokens = trainers["fp32"].global_batch_size * model_cfg.seq_len
    for trainer in trainers.values():                   # first steps allocate: not timed
        trainer.train_step(tokens)
    wall, cpu = {n: [] for n in PRECISIONS}, {n: [] for n in PRECISIONS}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        order = PRECISIONS[r % len(PRECISIONS):] + PRECISIONS[:r % len(PRECISIONS)]
        for name in order:
            w, c = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                trainers[name].train_step(tokens)
            wall[name].append(args.steps * step_tokens / (time.perf_counter() - w))
            cpu[name].append(args.steps * step_tokens / (time.process_time() - c))
    load_after = os.getloadavg()[0]
    for name, trainer in trainers.items():
        tracemalloc.start()
        trainer.train_step(tokens)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        ids, targets = trainer.microbatches(tokens, "train", 0)[0]
        allocated = sum(cache_nbytes(c) for c in trainer.model.forward(ids, targets)[1])
        recomputing = build_trainer(model_cfg, ParallelConfig(recompute="full").validate(),
                              TrainConfig(precision=name).validate(), Topology.serial())
        allocated_full = sum(cache_nbytes(c) for c in recomputing.model.forward(ids, targets)[1])
        print(json.dumps({
            "precision": name,
            "tokens_per_s_wall": float(np.median(wall[name])), "tokens_per_s_cpu": float(np.median(cpu[name])),
            "vs_fp32_wall": float(np.median(np.array(wall[name]) / wall["fp32"])),
            "vs_fp32_cpu": float(np.median(np.array(cpu[name]) / cpu["fp32"])),
            "peak_step_bytes": peak, "activation_bytes_allocated": allocated,
            "activation_bytes_full_recompute": allocated_full}))
    print(json.dumps({"load_average_1min": [load_before, load_after], "cores": os.cpu_count(),
                      "rounds": args.rounds, "steps_per_round": args.steps, "tokens_per_step": step_tokens}))


if __name__ == "__main__":
    main()
