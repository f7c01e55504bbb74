"""Tokens per second of generation on any tp x pp x dp mesh, as one JSON object.

    python benchmarks/generation.py
    mpiexec -n 2 python benchmarks/generation.py --pipeline-parallel-size 2
    mpiexec -n 2 python benchmarks/generation.py --data-parallel-size 2

A freshly initialised model (no checkpoint needed: the cost of a token does not depend
on the weights) generates --num-samples samples of --max-new-tokens tokens after a
--prompt-len prompt with the key/value cache (numpitron/generate.py), after one warm-up
run; tokens/s counts every sample's new tokens over the slowest rank's wall time.
Tensor parallelism splits each token's matmuls; pipeline stages pass each token on,
one stage busy at a time; data-parallel replicas each generate num_samples / dp.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

from mpi4py import MPI  # noqa: E402

from numpitron.cli import ArgumentParser, add_mesh_flags, add_model_flags, mesh_from_args  # noqa: E402
from numpitron.config import ModelConfig  # noqa: E402
from numpitron.distributed.topology import Topology  # noqa: E402
from numpitron.generate import generate  # noqa: E402
from numpitron.build import build_stage  # noqa: E402


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_mesh_flags(p)
    add_model_flags(p)
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=200)
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    cfg = ModelConfig(seq_len=args.seq_len, n_layers=args.n_layers, n_heads=args.n_heads, d_model=args.d_model,
                      dtype=args.dtype).validate()
    topo = Topology.from_mesh(world, mesh_from_args(args, world.Get_size(), cfg, None))
    model = build_stage(cfg, topo, seed=0)
    prompt = list(range(args.prompt_len))
    generate(model, prompt, 8, args.num_samples, temperature=1.0, seed=1)           # warm-up
    world.Barrier()
    start = time.perf_counter()
    generate(model, prompt, args.max_new_tokens, args.num_samples, temperature=1.0, seed=1)
    world.Barrier()
    seconds = time.perf_counter() - start
    if topo.is_logger:
        print(json.dumps({"mesh": {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp}, "num_samples": args.num_samples,
                          "new_tokens_per_sample": args.max_new_tokens, "seconds": round(seconds, 3),
                          "tokens_per_s": round(args.num_samples * args.max_new_tokens / seconds, 1),
                          "ms_per_step": round(1e3 * seconds / args.max_new_tokens, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    from numpitron.distributed.launch import run_main
    sys.exit(run_main(main))
