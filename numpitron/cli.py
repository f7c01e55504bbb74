"""Command-line flags shared by the entry points, mapped onto the config dataclasses."""

import argparse

from numpitron.config import DTYPES, ModelConfig, ParallelConfig, TrainConfig
from numpitron.errors import UserError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are a UserError (one line, printed by one rank) and whose
    --help is printed by rank 0 only."""

    def error(self, message):
        raise UserError(message)

    def print_help(self, file=None):
        from numpitron.distributed.launch import world_rank_and_size
        if world_rank_and_size()[0] == 0:
            super().print_help(file)


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", type=int, default=1)
    g.add_argument("--data-parallel-size", type=int, default=None, help="default: world / (tp * pp)")
    g.add_argument("--pipeline-schedule", choices=["gpipe", "1f1b"], default="1f1b")
    g.add_argument("--zero-stage", type=int, choices=[0, 1], default=0)
    g.add_argument("--bucket-size", type=int, default=ParallelConfig.bucket_size,
                   help="elements per data-parallel gradient all-reduce")
    g.add_argument("--blas-threads", type=int, default=1,
                   help="BLAS threads per rank (read before NumPy starts)")


def training_parser() -> ArgumentParser:
    p = ArgumentParser(description="Train a GPT on Tiny Shakespeare with tensor, pipeline and data parallelism.")
    d = TrainConfig()
    m = ModelConfig()
    add_parallel_flags(p)
    g = p.add_argument_group("model")
    g.add_argument("--n-layers", type=int, default=m.n_layers)
    g.add_argument("--n-heads", type=int, default=m.n_heads)
    g.add_argument("--d-model", type=int, default=m.d_model)
    g.add_argument("--seq-len", type=int, default=m.seq_len)
    g.add_argument("--dtype", choices=DTYPES, default=m.dtype)
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x dp")
    for name in ("max_iters", "eval_interval", "eval_iters", "warmup_iters", "lr_decay_iters", "log_interval",
                 "save_interval", "keep_checkpoints", "seed"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "min_lr", "weight_decay", "grad_clip", "beta1", "beta2"):
        g.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    g = p.add_argument_group("files")
    g.add_argument("--data-dir", default="data", help="where tinyshakespeare.txt and the prepared files live")
    g.add_argument("--input", default=None, help="a local tinyshakespeare.txt to use instead of downloading")
    g.add_argument("--out-dir", default="out", help="metrics.jsonl and checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def configs_from_args(args) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """Validated configs (identical checks on every rank, before any communication).
    The vocabulary size is filled in from the tokenizer later."""
    model = ModelConfig(seq_len=args.seq_len, n_layers=args.n_layers, n_heads=args.n_heads,
                        d_model=args.d_model, dtype=args.dtype).validate()
    parallel = ParallelConfig(tensor=args.tensor_parallel_size, pipeline=args.pipeline_parallel_size,
                              data=args.data_parallel_size or 1, schedule=args.pipeline_schedule,
                              zero_stage=args.zero_stage, bucket_size=args.bucket_size)
    train = TrainConfig(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size or 0,
                        **{k: getattr(args, k) for k in (
                            "max_iters", "eval_interval", "eval_iters", "warmup_iters", "lr_decay_iters",
                            "log_interval", "save_interval", "keep_checkpoints", "seed", "lr", "min_lr",
                            "weight_decay", "grad_clip", "beta1", "beta2")}).validate()
    return model, parallel, train
