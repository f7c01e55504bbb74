"""Configuration dataclasses and their validation.

Every check here runs identically on every rank before any communication, so a bad
configuration becomes one error message and never a hang.
"""

import functools
import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from numpitron.errors import UserError

DTYPES = ("float32", "float64")
# The pipeline schedules' names, the one place they are spelled (parallel/schedules.py
# builds each; a schedule with separate weight passes splits every layer's backward).
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = "gpipe", "1f1b", "interleaved", "zero-bubble"
ZB_V, DUALPIPE_V = "zb-v", "dualpipev"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, ZB_V, DUALPIPE_V)
SPLIT_BACKWARD = (ZERO_BUBBLE, ZB_V, DUALPIPE_V)
# Two chunks per rank placed in a V (distributed/stages.py): the first and the last
# virtual stage on pp rank 0.
V_SHAPED = (ZB_V, DUALPIPE_V)
RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "muon")
CONTEXT_PARALLEL_TYPES = ("ring", "ulysses", "hybrid")         # docs/13-context-parallelism.md


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 65
    seq_len: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 128
    dtype: str = "float32"
    # Mixture of experts (docs/14-experts.md); 0 experts: every block has the dense MLP.
    num_experts: int = 0
    moe_top_k: int = 2               # experts per token
    moe_every: int = 1               # block i is MoE when i % moe_every == 0
    moe_capacity_factor: float = 0.0 # 0: dropless
    moe_aux_loss_coef: float = 0.01  # Switch's alpha

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def itemsize(self) -> int:
        """Bytes of one element of every parameter, gradient, moment and activation."""
        return np.dtype(self.dtype).itemsize

    def is_moe_block(self, index: int) -> bool:
        return self.num_experts > 0 and index % self.moe_every == 0

    def validate(self, label=None) -> "ModelConfig":
        """label(field) names a field in messages: its flag by default; a config read
        from a file names its fields as the file does."""
        label = label or _flag
        _integers(self, "vocab_size", "seq_len", "n_layers", "n_heads", "d_model", label=label)
        _positive(self, "vocab_size", "seq_len", "n_layers", "n_heads", "d_model", label=label)
        if self.d_model % self.n_heads:
            raise UserError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        _integers(self, "num_experts", "moe_top_k", "moe_every", label=label)
        _finite(self, "moe_capacity_factor", "moe_aux_loss_coef", label=label)
        _non_negative(self, "num_experts", "moe_capacity_factor", "moe_aux_loss_coef", label=label)
        _positive(self, "moe_top_k", "moe_every", label=label)
        if self.num_experts and self.moe_top_k > self.num_experts:
            raise UserError(f"{label('moe_top_k')} ({self.moe_top_k}) must not exceed {label('num_experts')} "
                            f"({self.num_experts})")
        return self


ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ParallelConfig:
    """How to parallelise, beyond the mesh's sizes (which only the Topology holds)."""

    schedule: str = ONE_F_ONE_B      # one of SCHEDULES; only matters with pipeline stages
    virtual_stages: int = 1          # chunks of layers per pipeline rank (interleaved 1F1B; 2 for a V)
    zero_stage: int = 0
    bucket_size: int = 1 << 20       # elements per data-parallel gradient bucket
    overlap_grad_reduce: bool = True # start each bucket's all-reduce during the backward
    sequence_parallel: bool = False  # split LayerNorm/residual activations over tp along the sequence
    recompute: str = "none"          # "none", "selective" (attention probabilities) or "full" (blocks)
    context_parallel_type: str = "ring"  # attention over cp: the ring, Ulysses' all-to-all, or both
    ulysses_size: int = 0            # hybrid only: cp ranks per all-to-all group (the ring spans cp / it)
    tp_comm_overlap: bool = True     # start column-parallel input-gradient collectives before the weight gradient

    def __post_init__(self):
        if self.schedule in V_SHAPED and self.virtual_stages == 1:     # a V has two chunks per rank
            object.__setattr__(self, "virtual_stages", 2)

    @property
    def v_shaped(self) -> bool:
        return self.schedule in V_SHAPED

    def validate(self) -> "ParallelConfig":
        _integers(self, "virtual_stages", "ulysses_size")
        _positive(self, "bucket_size", "virtual_stages")
        _non_negative(self, "ulysses_size")
        if self.context_parallel_type not in CONTEXT_PARALLEL_TYPES:
            raise UserError(f"unknown context-parallel type {self.context_parallel_type!r}; choose one of "
                            f"{', '.join(CONTEXT_PARALLEL_TYPES)}")
        if (self.context_parallel_type == "hybrid") != (self.ulysses_size > 0):
            raise UserError(f"--context-parallel-type hybrid and --ulysses-size go together (got "
                            f"{self.context_parallel_type} with Ulysses size {self.ulysses_size or 'unset'})")
        if self.recompute not in RECOMPUTE:
            raise UserError(f"unknown recompute {self.recompute!r}; choose one of {', '.join(RECOMPUTE)}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"unknown pipeline schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.v_shaped and self.virtual_stages != 2:
            raise UserError(f"--pipeline-schedule {self.schedule} places exactly two chunks on each rank (a V): "
                            f"leave out --virtual-stages (got {self.virtual_stages})")
        if not self.v_shaped and (self.schedule == INTERLEAVED) != (self.virtual_stages > 1):
            raise UserError(f"--pipeline-schedule interleaved and --virtual-stages 2 or more go together "
                            f"(got {self.schedule} with {self.virtual_stages} virtual stages)")
        if self.zero_stage not in ZERO_STAGES:
            raise UserError(f"zero stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        return self

    def ulysses_group(self, context: int) -> int:
        """How many cp ranks share one Ulysses all-to-all (the ring spans context / it)."""
        return {"ring": 1, "ulysses": context, "hybrid": self.ulysses_size}[self.context_parallel_type]


def check_layout(model: ModelConfig, train, mesh, parallel=None) -> None:
    """Everything that must divide for this model to run on a mesh (tp, pp, dp, cp):
    checked identically on every rank before any communication. `mesh` is a Mesh
    (tp, pp, dp, cp, ep); the expert-parallel size may be left out (1)."""
    tensor, pipeline, data, context, *rest = mesh
    _check_experts(model, parallel, data, context, expert=rest[0] if rest else 1)
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
        if model.num_experts:
            raise UserError("--zero-stage 3 gathers each block's parameters from one flat buffer, and experts live "
                            "in a second one that only their own ranks hold; use --zero-stage 2 with --num-experts")
    if model.n_heads % tensor:
        raise UserError(f"n_heads ({model.n_heads}) must be divisible by the tensor-parallel size ({tensor})")
    if parallel is not None:
        _check_ulysses(model, tensor, context, parallel)
    if (4 * model.d_model) % tensor:
        raise UserError(f"the MLP width 4*d_model ({4 * model.d_model}) must be divisible by the "
                        f"tensor-parallel size ({tensor})")
    if model.n_layers % pipeline:
        raise UserError(f"n_layers ({model.n_layers}) must be divisible by the pipeline-parallel size ({pipeline})")
    if parallel is not None and parallel.v_shaped:
        _check_v_shape(model, train, pipeline, data, parallel.schedule)
    elif parallel is not None and parallel.virtual_stages > 1:
        _check_interleaving(model, train, pipeline, data, parallel.virtual_stages)
    if context > 1 and model.seq_len % (2 * context):
        raise UserError(f"seq_len ({model.seq_len}) must be divisible by 2 x the context-parallel size "
                        f"({2 * context}): each rank holds two chunks of every sequence (the zigzag split)")
    if train is not None:
        train.num_microbatches(data)
        train.check_rampup(data, pipeline, parallel is not None and parallel.virtual_stages > 1)
        if train.rampup_batch_size and model.num_experts:
            raise UserError("--rampup-batch-size changes the micro-batch count, which mixture-of-experts layers fix "
                            "when they are built (their aux loss's weight); not combined yet")


def _check_experts(model: ModelConfig, parallel, data: int, context: int, expert: int) -> None:
    """Expert parallelism splits the experts over ranks carved out of dp (docs/14-experts.md)."""
    if expert < 1:
        raise UserError(f"expert-parallel size must be positive, got {expert}")
    if expert > 1 and not model.num_experts:
        raise UserError("--expert-parallel-size splits experts over ranks: it needs --num-experts")
    if model.num_experts % expert:
        raise UserError(f"--num-experts ({model.num_experts}) must be divisible by the expert-parallel size "
                        f"({expert})")
    if data % expert:
        raise UserError(f"the expert-parallel size ({expert}) must divide the data-parallel size ({data}): "
                        f"the ep group is carved out of the data-parallel ranks")
    if model.num_experts and context > 1:
        raise UserError("mixture-of-experts layers route whole sequences: --num-experts does not combine with "
                        "--context-parallel-size yet")
    if model.num_experts and parallel is not None and parallel.sequence_parallel:
        raise UserError("mixture-of-experts layers route whole sequences: --num-experts does not combine with "
                        "--sequence-parallel yet")


def _check_ulysses(model: ModelConfig, tensor: int, context: int, parallel: ParallelConfig) -> None:
    """Ulysses splits each rank's H/tp heads over its all-to-all group (distributed/ulysses.py)."""
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
    """ZB-V and DualPipeV (parallel/schedules.py): 2p chunks of n_layers / 2p blocks,
    and rank 0 runs 2p - 1 forwards of its first chunk before its first backward."""
    if model.n_layers % (2 * pipeline):
        raise UserError(f"n_layers ({model.n_layers}) must be divisible by 2 x the pipeline-parallel size "
                        f"({2 * pipeline}): the {schedule} schedule gives each rank two chunks of whole layers")
    if train is not None and train.num_microbatches(data) < 2 * pipeline - 1:
        raise UserError(f"the {schedule} schedule needs at least 2 x pipeline-parallel size - 1 = {2 * pipeline - 1} "
                        f"micro-batches per step (rank 0 runs that many forwards before its first backward), got "
                        f"{train.num_microbatches(data)}: raise --global-batch-size")


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 12
    global_batch_size: int = 0          # 0: micro_batch_size * data-parallel size
    max_iters: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 0             # 0: max_iters
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0              # 0 disables clipping
    eval_interval: int = 250
    eval_iters: int = 200
    log_interval: int = 10
    save_interval: int = 0              # 0: only on improvement and at the end
    keep_checkpoints: int = 2
    seed: int = 1337
    optimizer: str = "adamw"            # or "muon": hidden matrices orthogonalised (optim/muon.py)
    muon_lr: float = 0.0                # 0: lr (Muon's update is scaled to AdamW's RMS)
    muon_momentum: float = 0.95
    # Megatron's --rampup-batch-size (start, increment, samples): the global batch grows
    # from start by increment, evenly over the first `samples` samples; () : no ramp-up.
    rampup_batch_size: tuple = ()

    def __post_init__(self):
        # A checkpoint's JSON gives a list back; a tuple keeps the config hashable.
        object.__setattr__(self, "rampup_batch_size", tuple(self.rampup_batch_size or ()))

    def validate(self) -> "TrainConfig":
        _positive(self, "micro_batch_size", "max_iters", "eval_interval", "eval_iters", "log_interval", "keep_checkpoints")
        _non_negative(self, "global_batch_size", "warmup_iters", "lr_decay_iters", "save_interval", "seed")
        _finite(self, "lr", "min_lr", "weight_decay", "grad_clip", "beta1", "beta2", "eps")
        _non_negative(self, "weight_decay", "grad_clip", "min_lr")
        _positive(self, "lr", "eps")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        _finite(self, "muon_lr", "muon_momentum")
        _non_negative(self, "muon_lr")
        if not 0 <= self.muon_momentum < 1:
            raise UserError(f"muon-momentum must lie in [0, 1), got {self.muon_momentum}")
        if self.rampup_batch_size:
            ramp = tuple(self.rampup_batch_size)
            if len(ramp) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in ramp):
                raise UserError(f"--rampup-batch-size takes three positive integers (start, increment, samples), "
                                f"got {self.rampup_batch_size!r}")
        if self.min_lr > self.lr:
            raise UserError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self

    def num_microbatches(self, data_parallel: int) -> int:
        """Megatron's semantics: micro-batches per dp rank are the accumulation steps."""
        global_batch = self.global_batch(data_parallel)
        per_step = self.micro_batch_size * data_parallel
        if global_batch % per_step:
            raise UserError(
                f"global batch size ({global_batch}) must be divisible by micro batch size "
                f"x data-parallel size ({self.micro_batch_size} x {data_parallel})")
        return global_batch // per_step

    def check_rampup(self, data_parallel: int, pipeline: int = 1, interleaved: bool = False) -> None:
        """Every batch of the ramp cuts into whole micro-batches of every dp rank (and, for
        the interleaved schedule, into groups of pp micro-batches)."""
        if not self.rampup_batch_size:
            return
        start, increment, _ = self.rampup_batch_size
        target, step = self.global_batch(data_parallel), self.micro_batch_size * data_parallel
        step *= pipeline if interleaved else 1
        if start % step or increment % step:
            raise UserError(f"--rampup-batch-size: start ({start}) and increment ({increment}) must be multiples of "
                            f"micro batch x data-parallel size{' x pipeline size (interleaved)' if interleaved else ''} "
                            f"({step}): every step's batch is cut into whole micro-batches on every rank")
        if start > target or (target - start) % increment:
            raise UserError(f"--rampup-batch-size: the global batch size ({target}) must be start ({start}) plus a "
                            f"whole number of increments ({increment})")

    def global_batch_at(self, iteration: int, data_parallel: int) -> int:
        """The global batch of `iteration`: Megatron's ramp-up (the batch grows by the
        increment each time another samples / increments samples have been consumed),
        then the global batch."""
        return _ramp(self, data_parallel)[min(iteration, self.max_iters - 1)] if self.rampup_batch_size \
            else self.global_batch(data_parallel)

    def global_batch(self, data_parallel: int) -> int:
        """Sequences per step: the flag, or one micro-batch per data-parallel rank."""
        return self.global_batch_size or self.micro_batch_size * data_parallel


@functools.lru_cache(maxsize=8)
def _ramp(cfg: "TrainConfig", data_parallel: int) -> tuple[int, ...]:
    """The global batch of every iteration of a ramp-up, from the samples consumed before it."""
    start, increment, samples = cfg.rampup_batch_size
    target = cfg.global_batch(data_parallel)
    per_increment = samples / max(1, (target - start) // increment)
    sizes, consumed = [], 0
    for _ in range(cfg.max_iters):
        sizes.append(min(target, start + int(consumed / per_increment) * increment))
        consumed += sizes[-1]
    return tuple(sizes)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _integers(cfg, *names, label=_flag):
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserError(f"{label(name)} must be an integer, got {value!r} ({type(value).__name__})")


def _finite(cfg, *names, label=_flag):
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise UserError(f"{label(name)} must be a finite number, got {value!r}")


def _positive(cfg, *names, label=_flag):
    for name in names:
        if not getattr(cfg, name) > 0:
            raise UserError(f"{label(name)} must be positive, got {getattr(cfg, name)}")


def _non_negative(cfg, *names, label=_flag):
    for name in names:
        if getattr(cfg, name) < 0:
            raise UserError(f"{label(name)} must not be negative, got {getattr(cfg, name)}")


def to_dict(cfg) -> dict:
    return asdict(cfg)


def from_dict(cls, values: dict):
    """Build a config from a saved dict, ignoring keys a newer version dropped."""
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})
