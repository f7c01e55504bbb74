"""check_layout: what must divide what, across the model, the batch, the strategies and
the mesh. It runs identically on every rank before any communication (cli.setup_training),
so a layout that cannot work is one line and never a hang."""

from numpitron.config import ModelConfig, ParallelConfig, SPLIT_BACKWARD
from numpitron.compression.checks import check_compression
from numpitron.diloco.checks import check_replicas
from numpitron.errors import UserError
from numpitron.precision.formats import check_precision


def check_layout(model: ModelConfig, train, mesh, parallel=None) -> None:
    """Everything that must divide for this model to run on a mesh (tp, pp, dp, cp):
    checked identically on every rank before any communication. `mesh` is a Mesh
    (tp, pp, dp, cp, ep); the expert-parallel size may be left out (1)."""
    tensor, pipeline, data, context, *rest = mesh
    if train is not None:
        check_precision(train.precision, model.dtype, train.loss_scale, train.loss_scale_window)
    _check_experts(model, parallel, data, context, expert=rest[0] if rest else 1,
                   data_shard=rest[1] if len(rest) > 1 and rest[1] else data)
    if parallel is not None and parallel.sequence_parallel:
        if tensor == 1:
            raise UserError("--sequence-parallel splits the sequence over tensor-parallel ranks: it needs "
                            "--tensor-parallel-size 2 or more")
        if (model.seq_len // context) % tensor:
            raise UserError(f"with --sequence-parallel each tp rank holds an equal part of the sequence: seq_len "
                            f"({model.seq_len}) / context-parallel size ({context}) must be divisible by the "
                            f"tensor-parallel size ({tensor})")
    if parallel is not None and parallel.zero_stage == 3:
        if pipeline > 1:
            raise UserError("--zero-stage 3 with pipeline parallelism would all-gather every stage's parameters "
                            "again for every micro-batch; use --zero-stage 2 (or 1) with --pipeline-parallel-size")
        if parallel.sequence_parallel:
            raise UserError("--zero-stage 3 reduce-scatters each layer's gradients when its backward ends, but "
                            "--sequence-parallel sums LayerNorm gradients over tp only after the whole backward; "
                            "use --zero-stage 2 with --sequence-parallel")
        if parallel.schedule in SPLIT_BACKWARD:
            raise UserError(f"--zero-stage 3 gathers a layer's parameters around its whole backward, and the "
                            f"{parallel.schedule} schedule splits that backward into two passes; use another schedule")
    if model.n_heads % tensor:
        raise UserError(f"n_heads ({model.n_heads}) must be divisible by the tensor-parallel size ({tensor})")
    if parallel is not None:
        _check_ulysses(model, tensor, context, parallel)
    if (4 * model.d_model) % tensor:
        raise UserError(f"the MLP width 4*d_model ({4 * model.d_model}) must be divisible by the "
                        f"tensor-parallel size ({tensor})")
    if model.num_experts and model.expert_hidden % tensor:
        raise UserError(f"--moe-expert-hidden ({model.expert_hidden}) must be divisible by the tensor-parallel "
                        f"size ({tensor})")
    if model.n_layers % pipeline:
        raise UserError(f"n_layers ({model.n_layers}) must be divisible by the pipeline-parallel size ({pipeline})")
    if parallel is not None and parallel.v_shaped:
        _check_v_shape(model, train, pipeline, data, parallel.schedule)
    elif parallel is not None and parallel.virtual_stages > 1:
        _check_interleaving(model, train, pipeline, data, parallel.virtual_stages)
    if context > 1 and model.seq_len % (2 * context):
        raise UserError(f"seq_len ({model.seq_len}) must be divisible by 2 x the context-parallel size "
                        f"({2 * context}): each rank holds two chunks of every sequence (the zigzag split)")
    if parallel is not None:
        check_compression(model, train, parallel)             # compression/checks.py
    if train is not None and train.diloco_replicas:
        check_replicas(train.diloco_replicas, data, context, rest[0] if rest else 1,
                      rest[1] if len(rest) > 1 and rest[1] else data)
    if train is not None:
        train.num_microbatches(data)
        v_shaped = parallel is not None and parallel.v_shaped
        train.check_rampup(data, pipeline, parallel is not None and parallel.virtual_stages > 1 and not v_shaped)
        if v_shaped and train.rampup_batch_size \
                and train.rampup_batch_size[0] // (train.micro_batch_size * data) < 2 * pipeline - 1:
            raise UserError(f"--rampup-batch-size: the {parallel.schedule} schedule needs at least {2 * pipeline - 1} "
                            f"micro-batches per step from the first one on; raise the ramp's start")


def _check_experts(model: ModelConfig, parallel, data: int, context: int, expert: int, data_shard: int) -> None:
    """Expert parallelism splits the experts over ranks carved out of dp x cp (docs/13-experts.md);
    under hybrid sharding an ep group stays inside one replica (docs/09-zero-2-and-3.md)."""
    if expert < 1:
        raise UserError(f"expert-parallel size must be positive, got {expert}")
    if expert > 1 and not model.num_experts:
        raise UserError("--expert-parallel-size splits experts over ranks: it needs --num-experts")
    if model.num_experts % expert:
        raise UserError(f"--num-experts ({model.num_experts}) must be divisible by the expert-parallel size "
                        f"({expert})")
    if (data * context) % expert:
        raise UserError(f"the expert-parallel size ({expert}) must divide data x context parallel size ({data} x "
                        f"{context} = {data * context}): the ep group is carved out of the ranks that hold "
                        f"different tokens")
    if data_shard < data and (data_shard * context) % expert:
        raise UserError(f"the expert-parallel size ({expert}) must divide --data-parallel-shard-size x context "
                        f"parallel size ({data_shard} x {context}): an ep group's all-to-all stays inside one "
                        f"replica, and its experts shard there")


def _check_ulysses(model: ModelConfig, tensor: int, context: int, parallel: ParallelConfig) -> None:
    """Ulysses splits each rank's H/tp heads over its all-to-all group (context_parallel/ulysses.py)."""
    group, heads = parallel.ulysses_group(context), model.n_heads // tensor
    if context % group:
        raise UserError(f"--ulysses-size ({group}) must divide the context-parallel size ({context})")
    if heads % group:
        name = "context-parallel size" if parallel.context_parallel_type == "ulysses" else "--ulysses-size"
        raise UserError(f"{parallel.context_parallel_type} context parallelism gives each rank whole heads: n_heads / "
                        f"tensor-parallel size ({model.n_heads} / {tensor} = {heads}) must be divisible by the "
                        f"{name} ({group})")


def _check_interleaving(model: ModelConfig, train, pipeline: int, data: int, virtual: int) -> None:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2.2): each of the p ranks holds v
    chunks of n_layers / (p v) blocks, and the micro-batches go round in groups of p."""
    if pipeline < 2:
        raise UserError(f"--virtual-stages {virtual} interleaves chunks over pipeline ranks: it needs "
                        f"--pipeline-parallel-size 2 or more")
    if model.n_layers % (pipeline * virtual):
        raise UserError(f"n_layers ({model.n_layers}) must be divisible by pipeline-parallel size x virtual "
                        f"stages ({pipeline} x {virtual} = {pipeline * virtual}): every chunk holds whole layers")
    if train is not None and train.num_microbatches(data) % pipeline:
        raise UserError(f"the interleaved schedule takes micro-batches in groups of the pipeline-parallel size: "
                        f"{train.num_microbatches(data)} micro-batches per step is not a multiple of {pipeline} "
                        f"(set --global-batch-size to micro batch x dp x a multiple of {pipeline})")


def _check_v_shape(model: ModelConfig, train, pipeline: int, data: int, schedule: str) -> None:
    """ZB-V and DualPipeV (pipeline_parallel/schedules.py): 2p chunks of n_layers / 2p blocks,
    and rank 0 runs 2p - 1 forwards of its first chunk before its first backward."""
    if model.n_layers % (2 * pipeline):
        raise UserError(f"n_layers ({model.n_layers}) must be divisible by 2 x the pipeline-parallel size "
                        f"({2 * pipeline}): the {schedule} schedule gives each rank two chunks of whole layers")
    if train is not None and train.num_microbatches(data) < 2 * pipeline - 1:
        raise UserError(f"the {schedule} schedule needs at least 2 x pipeline-parallel size - 1 = {2 * pipeline - 1} "
                        f"micro-batches per step (rank 0 runs that many forwards before its first backward), got "
                        f"{train.num_microbatches(data)}: raise --global-batch-size")

