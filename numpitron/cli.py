"""Command-line flags shared by every entry point, and the one function that turns
them (and the MPI world) into validated configs and a Topology."""

import argparse
import math

from numpitron.config import CONTEXT_PARALLEL_TYPES, OPTIMIZERS
from numpitron.config import DTYPES, LOAD_BALANCING, RECOMPUTE, SCHEDULES, ZERO_STAGES, ModelConfig, ParallelConfig, TrainConfig
from numpitron.layout import check_layout
from numpitron.distributed.watchdog import DEFAULT_TIMEOUT_S
from numpitron.errors import UserError
from numpitron.precision.formats import GRAD_REDUCE_DTYPES


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are a UserError (one line, printed by one rank) and whose
    --help is printed by rank 0 only."""

    def error(self, message):
        raise UserError(message)

    def parse_known_args(self, args=None, namespace=None):
        # --config FILE.toml: the file's values become defaults, so flags still win.
        if any(action.dest == "config" for action in self._actions):
            from numpitron.config_file import config_path_in, read_config
            path = config_path_in(args)
            if path is not None:
                self.set_defaults(**read_config(path, self))
        return super().parse_known_args(args, namespace)

    def print_help(self, file=None):
        from numpitron.distributed.launch import world_rank_and_size
        if world_rank_and_size()[0] == 0:
            super().print_help(file)


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml",
                   help="flags from a file: each flag's name with underscores as a key, in the section of its "
                        "group below (configs/ has examples); flags given here win")


def add_mesh_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mesh")
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks that split every sequence (ring attention)")
    g.add_argument("--data-parallel-size", type=int, default=None, help="default: world / (tp * cp * pp)")
    g.add_argument("--expert-parallel-size", type=int, default=1,
                   help="data x context parallel ranks that split the experts among them (must divide dp x cp)")
    g.add_argument("--data-parallel-shard-size", type=int, default=None,
                   help="hybrid sharding: dp ranks that shard ZeRO's state, on one host (must divide dp; "
                        "default dp); the dp / S replicas average across hosts")
    g.add_argument("--blas-threads", type=int, default=1,
                   help="BLAS threads per rank (read before NumPy starts)")
    g.add_argument("--collective-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="a rank that waits longer in one collective ends the job, naming itself and the "
                        "collective (0: wait forever)")


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    d = ParallelConfig()
    g = p.add_argument_group("parallelism")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default=d.schedule,
                   help="the order of forwards and backwards on each stage (docs/09-pipeline-schedules.md)")
    g.add_argument("--virtual-stages", type=int, default=d.virtual_stages,
                   help="chunks of layers per pipeline rank, with --pipeline-schedule interleaved "
                        "(zb-v and dualpipev: always 2, placed in a V)")
    g.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=d.zero_stage,
                   help="shard over dp: 1 the optimizer state, 2 also the gradients, 3 also the parameters")
    g.add_argument("--bucket-size", type=int, default=d.bucket_size,
                   help="elements per data-parallel gradient bucket")
    g.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                   help="reduce gradients after the backward instead of during it")
    g.add_argument("--hierarchical-all-reduce", action="store_true",
                   help="plain dp: sum gradients in two levels, inside the shard group then across the replicas")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split LayerNorm and residual activations over tp along the sequence")
    g.add_argument("--recompute", choices=RECOMPUTE, default=d.recompute,
                   help="recompute in the backward: nothing, the attention probabilities, or whole blocks")
    g.add_argument("--context-parallel-type", choices=CONTEXT_PARALLEL_TYPES, default=d.context_parallel_type,
                   help="attention over the cp ranks: keys and values around a ring, an all-to-all over heads "
                        "(Ulysses), or Ulysses groups joined by a ring (hybrid)")
    g.add_argument("--ulysses-size", type=int, default=d.ulysses_size,
                   help="with --context-parallel-type hybrid: cp ranks per all-to-all group")
    g.add_argument("--tp-comm-overlap", action=argparse.BooleanOptionalAction, default=d.tp_comm_overlap,
                   help="hide each column-parallel layer's input-gradient collective behind its weight gradient")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    m = ModelConfig()
    g = p.add_argument_group("model")
    g.add_argument("--n-layers", type=int, default=m.n_layers)
    g.add_argument("--n-heads", type=int, default=m.n_heads)
    g.add_argument("--d-model", type=int, default=m.d_model)
    g.add_argument("--seq-len", type=int, default=m.seq_len)
    g.add_argument("--dtype", choices=DTYPES, default=m.dtype)
    g.add_argument("--num-experts", type=int, default=m.num_experts,
                   help="mixture of experts: E expert MLPs per MoE block (0: the dense MLP)")
    g.add_argument("--moe-top-k", type=int, default=m.moe_top_k, help="experts per token")
    g.add_argument("--moe-every", type=int, default=m.moe_every,
                   help="block i has experts when i %% N == 0 (the others stay dense)")
    g.add_argument("--moe-capacity-factor", type=float, default=m.moe_capacity_factor,
                   help="an expert takes at most ceil(c k T / E) of a sequence's tokens; 0: dropless")
    g.add_argument("--moe-aux-loss-coef", type=float, default=m.moe_aux_loss_coef,
                   help="weight of the load-balancing loss (Switch's alpha; unused with --moe-load-balancing bias)")
    g.add_argument("--moe-load-balancing", choices=LOAD_BALANCING, default=m.moe_load_balancing,
                   help="aux-loss: Switch's loss; bias: a per-expert routing bias nudged after each step")
    g.add_argument("--moe-bias-update-rate", type=float, default=m.moe_bias_update_rate,
                   help="with --moe-load-balancing bias: the bias moves by u * sign(mean load - load) per step")
    g.add_argument("--moe-shared-experts", type=int, default=m.moe_shared_experts,
                   help="dense experts every token passes beside its routed ones (DeepSeekMoE)")
    g.add_argument("--moe-expert-hidden", type=int, default=m.moe_expert_hidden,
                   help="hidden width of each expert (0: 4 * d-model); smaller for finer-grained experts")


def add_training_flags(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x dp")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"), default=None,
                   help="grow the global batch from START by INCREMENT, evenly over the first SAMPLES samples "
                        "(Megatron's semantics)")
    for name in ("max_iters", "eval_interval", "eval_iters", "warmup_iters", "lr_decay_iters", "log_interval",
                 "save_interval", "keep_checkpoints", "seed"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "min_lr", "weight_decay", "grad_clip", "beta1", "beta2"):
        g.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    g.add_argument("--precision", default=d.precision,
                   help="fp32, or bf16 / fp16 / fp8 (linear layers' products in FP8, the rest bf16) with fp32 master "
                        "weights (docs/16-numbers.md)")
    g.add_argument("--loss-scale", type=float, default=d.loss_scale,
                   help="initial loss scale, a power of two (0: fp16 starts at 2^16, the others use none)")
    g.add_argument("--loss-scale-window", type=int, default=d.loss_scale_window,
                   help="fp16: clean steps before the loss scale doubles")
    g.add_argument("--grad-reduce-dtype", choices=GRAD_REDUCE_DTYPES, default=d.grad_reduce_dtype,
                   help="bf16/fp16: sum gradients over dp in fp32 (4 bytes an element) or in the "
                        "parameters' format (param: 2 bytes)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer,
                   help="muon: Newton-Schulz-orthogonalised momentum for the blocks' matrices, AdamW for the rest")
    g.add_argument("--muon-lr", type=float, default=d.muon_lr, help="Muon's peak learning rate (0: --lr)")
    g.add_argument("--muon-momentum", type=float, default=d.muon_momentum)


def training_parser(description: str = "Train a GPT on Tiny Shakespeare on any mesh.") -> ArgumentParser:
    """The training script's flags; the benchmark adds its own to the same parser."""
    p = ArgumentParser(description=description)
    add_config_flag(p)
    add_mesh_flags(p)
    add_parallel_flags(p)
    add_model_flags(p)
    add_training_flags(p)
    return p


def add_file_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("files")
    g.add_argument("--data-dir", default="data", help="where tinyshakespeare.txt and the prepared files live")
    g.add_argument("--input", default=None, help="a local tinyshakespeare.txt to use instead of downloading")
    g.add_argument("--out-dir", default="out", help="metrics.jsonl and checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run in --out-dir (its metrics.jsonl and the checkpoints this library wrote)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def configs_from_args(args) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """Each config validated on its own (no mesh yet). The vocabulary size is filled
    in from the tokenizer later; nothing checked here depends on it."""
    model = ModelConfig(seq_len=args.seq_len, n_layers=args.n_layers, n_heads=args.n_heads,
                        d_model=args.d_model, dtype=args.dtype, num_experts=args.num_experts,
                        moe_top_k=args.moe_top_k, moe_every=args.moe_every,
                        moe_capacity_factor=args.moe_capacity_factor,
                        moe_aux_loss_coef=args.moe_aux_loss_coef, moe_load_balancing=args.moe_load_balancing,
                        moe_bias_update_rate=args.moe_bias_update_rate,
                        moe_shared_experts=args.moe_shared_experts,
                        moe_expert_hidden=args.moe_expert_hidden).validate()
    parallel = ParallelConfig(schedule=args.pipeline_schedule, virtual_stages=args.virtual_stages,
                              zero_stage=args.zero_stage,
                              bucket_size=args.bucket_size, overlap_grad_reduce=args.overlap_grad_reduce,
                              hierarchical_all_reduce=args.hierarchical_all_reduce,
                              sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                              context_parallel_type=args.context_parallel_type, ulysses_size=args.ulysses_size,
                              tp_comm_overlap=args.tp_comm_overlap).validate()
    train = TrainConfig(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size or 0,
                        rampup_batch_size=tuple(args.rampup_batch_size or ()),
                        **{k: getattr(args, k) for k in (
                            "max_iters", "eval_interval", "eval_iters", "warmup_iters", "lr_decay_iters",
                            "log_interval", "save_interval", "keep_checkpoints", "seed", "lr", "min_lr",
                            "weight_decay", "grad_clip", "beta1", "beta2", "precision", "loss_scale",
                            "loss_scale_window", "grad_reduce_dtype", "optimizer", "muon_lr", "muon_momentum")}).validate()
    return model, parallel, train


def mesh_from_args(args, world_size: int, model: ModelConfig, train: TrainConfig | None,
                   parallel: ParallelConfig | None = None):
    """The Mesh for this world, after every check that involves it."""
    from numpitron.distributed.topology import resolve_mesh
    if args.blas_threads < 1:
        raise UserError(f"--blas-threads must be positive, got {args.blas_threads}")
    if not math.isfinite(args.collective_timeout) or args.collective_timeout < 0:
        raise UserError(f"--collective-timeout must be a finite number of seconds >= 0, got {args.collective_timeout}")
    mesh = resolve_mesh(world_size, args.tensor_parallel_size, args.pipeline_parallel_size,
                        args.data_parallel_size, args.context_parallel_size, args.expert_parallel_size,
                        args.data_parallel_shard_size)
    check_layout(model, train, mesh, parallel)
    return mesh


def setup_training(args, world=None):
    """(model, parallel, train configs, Topology) from the parsed flags: every check
    runs identically on every rank, then the communicators are split."""
    from mpi4py import MPI

    from numpitron.distributed.topology import Topology
    world = world or MPI.COMM_WORLD
    model, parallel, train = configs_from_args(args)
    mesh = mesh_from_args(args, world.Get_size(), model, train, parallel)
    return model, parallel, train, Topology.from_mesh(world, mesh, args.collective_timeout,
                                                      parallel.ulysses_group(mesh.cp))
