"""Configuration dataclasses and their validation.

Every check here runs identically on every rank before any communication, so a bad
configuration becomes one error message and never a hang.
"""

import functools
import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from numpitron.errors import UserError
from numpitron.pipeline_parallel.schedules import (INTERLEAVED, ONE_F_ONE_B, SCHEDULES, SPLIT_BACKWARD,  # noqa: F401
                                                   V_SHAPED)  # the names are spelled beside the schedules
from numpitron.precision.formats import GRAD_REDUCE_DTYPES, check_precision
from numpitron.rampup import Ramp

DTYPES = ("float32", "float64")
RECOMPUTE = ("none", "selective", "full")
LOAD_BALANCING = ("aux-loss", "bias")                          # docs/11-experts.md
CONTEXT_PARALLEL_TYPES = ("ring", "ulysses", "hybrid")         # docs/10-context-parallelism.md
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 65
    seq_len: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 128
    dtype: str = "float32"
    # Mixture of experts (docs/11-experts.md); 0 experts: every block has the dense MLP.
    num_experts: int = 0
    moe_top_k: int = 2               # experts per token
    moe_every: int = 1               # block i is MoE when i % moe_every == 0
    moe_capacity_factor: float = 0.0 # 0: dropless
    moe_aux_loss_coef: float = 0.01  # Switch's alpha
    moe_load_balancing: str = "aux-loss"  # or "bias": aux-loss-free (DeepSeek-V3 §2.1.2)
    moe_bias_update_rate: float = 0.001   # the bias's step u per iteration
    moe_shared_experts: int = 0      # dense experts every token passes (DeepSeekMoE)
    moe_expert_hidden: int = 0       # each expert's hidden width; 0: 4 * d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def itemsize(self) -> int:
        """Bytes of one element of every parameter, gradient, moment and activation."""
        return np.dtype(self.dtype).itemsize

    def is_moe_block(self, index: int) -> bool:
        return self.num_experts > 0 and index % self.moe_every == 0

    @property
    def expert_hidden(self) -> int:
        """The hidden width of every expert, routed or shared."""
        return self.moe_expert_hidden or 4 * self.d_model

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
        _integers(self, "num_experts", "moe_top_k", "moe_every", "moe_shared_experts", "moe_expert_hidden",
                  label=label)
        _finite(self, "moe_capacity_factor", "moe_aux_loss_coef", "moe_bias_update_rate", label=label)
        _non_negative(self, "num_experts", "moe_capacity_factor", "moe_aux_loss_coef", "moe_bias_update_rate",
                      "moe_shared_experts", "moe_expert_hidden", label=label)
        if self.moe_load_balancing not in LOAD_BALANCING:
            raise UserError(f"unknown {label('moe_load_balancing')} {self.moe_load_balancing!r}; choose one of "
                            f"{', '.join(LOAD_BALANCING)}")
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
    hierarchical_all_reduce: bool = False  # plain dp: sum gradients in two levels (dp_shard, then dp_replica)
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
        if self.hierarchical_all_reduce and self.zero_stage:
            raise UserError("--hierarchical-all-reduce is for plain data parallelism: with --zero-stage "
                            f"{self.zero_stage}, --data-parallel-shard-size already reduces in two levels")
        return self

    def ulysses_group(self, context: int) -> int:
        """How many cp ranks share one Ulysses all-to-all (the ring spans context / it)."""
        return {"ring": 1, "ulysses": context, "hybrid": self.ulysses_size}[self.context_parallel_type]


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
    # Mixed precision (docs/16-numbers.md): fp32, or bf16 / fp16 / fp8 with fp32 master weights.
    precision: str = "fp32"
    loss_scale: float = 0.0             # the initial loss scale; 0: the format's (fp16 2^16, else 1)
    loss_scale_window: int = 1000       # fp16: clean steps before the scale doubles
    grad_reduce_dtype: str = "fp32"     # gradients summed over dp in fp32, or "param": the low format
    optimizer: str = "adamw"            # or "muon": hidden matrices orthogonalised (muon/muon.py)
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
        if self.optimizer != "muon" and (self.muon_lr, self.muon_momentum) != (0.0, TrainConfig.muon_momentum):
            raise UserError(f"--muon-lr and --muon-momentum set Muon, and this run uses --optimizer {self.optimizer}")
        if not 0 <= self.muon_momentum < 1:
            raise UserError(f"muon-momentum must lie in [0, 1), got {self.muon_momentum}")
        if self.rampup_batch_size:
            ramp = tuple(self.rampup_batch_size)
            if len(ramp) != 3 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in ramp):
                raise UserError(f"--rampup-batch-size takes three positive integers (start, increment, samples), "
                                f"got {self.rampup_batch_size!r}")
        if self.min_lr > self.lr:
            raise UserError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        check_precision(self.precision, "float32", self.loss_scale, self.loss_scale_window)
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise UserError(f"unknown --grad-reduce-dtype {self.grad_reduce_dtype!r}; choose one of "
                            f"{', '.join(GRAD_REDUCE_DTYPES)}")
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
        return _ramp(self, data_parallel).at(min(iteration, self.max_iters - 1)) if self.rampup_batch_size \
            else self.global_batch(data_parallel)

    def global_batch(self, data_parallel: int) -> int:
        """Sequences per step: the flag, or one micro-batch per data-parallel rank."""
        return self.global_batch_size or self.micro_batch_size * data_parallel


@functools.lru_cache(maxsize=8)
def _ramp(cfg: "TrainConfig", data_parallel: int) -> Ramp:
    """The ramp's stages, worked out as far as asked (rampup.py): never one per iteration."""
    return Ramp(*cfg.rampup_batch_size, cfg.global_batch(data_parallel))


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
