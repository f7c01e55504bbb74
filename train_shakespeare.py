"""Train a GPT on Tiny Shakespeare on any mesh.

    python train_shakespeare.py
    mpiexec -n 4 python train_shakespeare.py --tensor-parallel-size 2 --data-parallel-size 2
    mpiexec -n 8 python train_shakespeare.py --tensor-parallel-size 2 --pipeline-parallel-size 2 --zero-stage 1
    mpiexec -n 8 python train_shakespeare.py --config configs/tp2_pp2_zero1.toml     # the same, from a file
    python train_shakespeare.py --config out/config.toml --out-dir again             # repeat a run
"""

import sys

from numpitron.runtime import configure_process

configure_process(sys.argv)   # BLAS threads and MPI yield: before NumPy and MPI start


def main(argv=None) -> int:
    from numpitron.cli import add_file_flags, setup_training, training_parser
    from numpitron.config_file import config_toml
    from numpitron.trace.tracer import TraceRequest
    from numpitron.train import train

    parser = training_parser()
    add_file_flags(parser)
    args = parser.parse_args(argv)
    trace = TraceRequest.from_flags(args.trace, args.trace_iters)
    model_cfg, parallel_cfg, train_cfg, topo = setup_training(args)
    # What the mesh derived, written out: the run's config.toml repeats it exactly.
    args.data_parallel_size, args.global_batch_size = topo.dp, train_cfg.global_batch(topo.dp)
    result = train(model_cfg, parallel_cfg, train_cfg, topo, args.data_dir, args.out_dir,
                   resume=args.resume, progress=not args.no_progress, input_path=args.input,
                   overwrite=args.overwrite, reseed=args.reseed, trace=trace,
                   run_config=config_toml(parser, args, leave_out=("resume", "overwrite", "reseed", "trace",
                                                                   "trace_iters")))
    if topo.is_logger and result["trained"]:
        val = "" if result["val_loss"] is None else f", val loss {result['val_loss']:.4f}"
        print(f"done: {result['iterations']} iterations{val}, {result['elapsed_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    from numpitron.distributed.launch import run_main
    sys.exit(run_main(main))
