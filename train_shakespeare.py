"""Train a GPT on Tiny Shakespeare on any mesh.

    python train_shakespeare.py
    mpiexec -n 4 python train_shakespeare.py --tensor-parallel-size 2 --data-parallel-size 2
    mpiexec -n 8 python train_shakespeare.py --tensor-parallel-size 2 --pipeline-parallel-size 2 --zero-stage 1
"""

import sys

from numpitron.runtime import configure_process

configure_process(sys.argv)   # BLAS threads and MPI yield: before NumPy and MPI start


def main(argv=None) -> int:
    from dataclasses import replace

    from numpitron.cli import configs_from_args, training_parser
    from numpitron.distributed.launch import world_rank_and_size
    from numpitron.distributed.topology import Topology, resolve_mesh
    from numpitron.train import train

    args = training_parser().parse_args(argv)
    model_cfg, parallel_cfg, train_cfg = configs_from_args(args)
    _, world_size = world_rank_and_size()
    tp, pp, dp = resolve_mesh(world_size, parallel_cfg.tensor, parallel_cfg.pipeline, args.data_parallel_size)
    parallel_cfg = replace(parallel_cfg, data=dp).validate(model_cfg)
    train_cfg.num_microbatches(dp)      # a batch that does not divide is an error before any communication
    topo = Topology.from_world(tp, pp, dp)
    result = train(model_cfg, parallel_cfg, train_cfg, topo, args.data_dir, args.out_dir,
                   resume=args.resume, progress=not args.no_progress, input_path=args.input)
    if topo.is_logger:
        val = "" if result["val_loss"] is None else f", val loss {result['val_loss']:.4f}"
        print(f"done: {result['iterations']} iterations{val}, {result['elapsed_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    from numpitron.distributed.launch import run_main
    sys.exit(run_main(main))
