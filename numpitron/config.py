"""Configuration dataclasses and their validation.

Every field declared with `setting` is also a command-line flag and a key of a --config
file, in the section its class names (config_fields.py): this is the one place they
are declared. Every check here runs identically on every rank before any
communication, so a bad configuration becomes one error message and never a hang.
"""

import functools
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import numpy as np

from numpitron.blas.setting import BlasSetting
from numpitron.compression.checks import COMPRESSIONS
from numpitron.diloco.checks import check_diloco
from numpitron.diloco.settings import DilocoSettings
from numpitron.config_fields import as_flag, finite, integers, non_negative, positive, setting
from numpitron.errors import UserError
from numpitron.pipeline_parallel.schedules import (INTERLEAVED, ONE_F_ONE_B, SCHEDULES, SPLIT_BACKWARD,  # noqa: F401
                                                   V_SHAPED)  # the names are spelled beside the schedules
from numpitron.precision.formats import GRAD_REDUCE_DTYPES, check_precision
from numpitron.rampup import Ramp

DTYPES, RECOMPUTE = ("float32", "float64"), ("none", "selective", "full")
LOAD_BALANCING = ("aux-loss", "bias")                          # docs/13-experts.md
CONTEXT_PARALLEL_TYPES = ("ring", "ulysses", "hybrid")         # docs/12-context-parallelism.md
OPTIMIZERS, ZERO_STAGES = ("adamw", "muon", "sgd"), (0, 1, 2, 3)


@dataclass(frozen=True)
class ModelConfig:
    SECTION: ClassVar[str] = "model"        # its flags' --help group and its section of a --config file

    vocab_size: int = 65                    # no flag: the tokenizer's (the planner has --vocab-size)
    n_layers: int = setting(4)
    n_heads: int = setting(4)
    d_model: int = setting(128)
    seq_len: int = setting(64)
    dtype: str = setting("float32", choices=DTYPES)
    # Mixture of experts (docs/13-experts.md); 0 experts: every block has the dense MLP.
    num_experts: int = setting(0, "mixture of experts: E expert MLPs per MoE block (0: the dense MLP)")
    moe_top_k: int = setting(2, "experts per token")
    moe_every: int = setting(1, "block i has experts when i % N == 0 (the others stay dense)")
    moe_capacity_factor: float = setting(0.0, "an expert takes at most ceil(c k T / E) of a sequence's tokens; "
                                              "0: dropless")
    moe_aux_loss_coef: float = setting(0.01, "weight of the load-balancing loss (Switch's alpha; unused with "
                                             "--moe-load-balancing bias)")
    # "bias": aux-loss-free balancing (DeepSeek-V3 §2.1.2)
    moe_load_balancing: str = setting("aux-loss", "aux-loss: Switch's loss; bias: a per-expert routing bias nudged "
                                                  "after each step", choices=LOAD_BALANCING)
    moe_bias_update_rate: float = setting(0.001, "with --moe-load-balancing bias: the bias moves by "
                                                 "u * sign(mean load - load) per step")
    moe_shared_experts: int = setting(0, "dense experts every token passes beside its routed ones (DeepSeekMoE)")
    moe_expert_hidden: int = setting(
        0, "hidden width of each expert (0: 4 * d-model); smaller for finer-grained experts")

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
        label = label or as_flag
        integers(self, "vocab_size", "seq_len", "n_layers", "n_heads", "d_model", label=label)
        positive(self, "vocab_size", "seq_len", "n_layers", "n_heads", "d_model", label=label)
        if self.d_model % self.n_heads:
            raise UserError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        integers(self, "num_experts", "moe_top_k", "moe_every", "moe_shared_experts", "moe_expert_hidden",
                 label=label)
        finite(self, "moe_capacity_factor", "moe_aux_loss_coef", "moe_bias_update_rate", label=label)
        non_negative(self, "num_experts", "moe_capacity_factor", "moe_aux_loss_coef", "moe_bias_update_rate",
                     "moe_shared_experts", "moe_expert_hidden", label=label)
        if self.moe_load_balancing not in LOAD_BALANCING:
            raise UserError(f"unknown {label('moe_load_balancing')} {self.moe_load_balancing!r}; choose one of "
                            f"{', '.join(LOAD_BALANCING)}")
        positive(self, "moe_top_k", "moe_every", label=label)
        if self.num_experts and self.moe_top_k > self.num_experts:
            raise UserError(f"{label('moe_top_k')} ({self.moe_top_k}) must not exceed {label('num_experts')} "
                            f"({self.num_experts})")
        return self


@dataclass(frozen=True)
class ParallelConfig(BlasSetting):
    """How to parallelise, beyond the mesh's sizes (the Topology's); and --blas (blas/setting.py)."""
    SECTION: ClassVar[str] = "parallelism"

    schedule: str = setting(ONE_F_ONE_B, "the order of forwards and backwards on each stage "
                            "(docs/11-pipeline-schedules.md)", choices=SCHEDULES, flag="pipeline-schedule")
    virtual_stages: int = setting(1, "chunks of layers per pipeline rank, with --pipeline-schedule interleaved "
                                     "(zb-v and dualpipev: always 2, placed in a V)")
    zero_stage: int = setting(0, "shard over dp: 1 the optimizer state, 2 also the gradients, 3 also the "
                                 "parameters", choices=ZERO_STAGES)
    bucket_size: int = setting(1 << 20, "elements per data-parallel gradient bucket")
    overlap_grad_reduce: bool = setting(True, "reduce gradients after the backward instead of during it",
                                        flag="no-overlap-grad-reduce")
    hierarchical_all_reduce: bool = setting(False, "plain dp: sum gradients in two levels: shard group, replicas")
    grad_compression: str = setting("none", "plain dp: gradients sent as int8 or PowerSGD factors", choices=COMPRESSIONS)
    powersgd_rank: int = setting(4, "--grad-compression powersgd: the rank r of each matrix's factors")
    sequence_parallel: bool = setting(False, "split LayerNorm and residual activations over tp along the sequence")
    recompute: str = setting("none", "recompute in the backward: nothing, the attention probabilities, or whole "
                                     "blocks", choices=RECOMPUTE)
    context_parallel_type: str = setting("ring", "attention over the cp ranks: keys and values around a ring, an "
                                         "all-to-all over heads (Ulysses), or Ulysses groups joined by a ring "
                                         "(hybrid)", choices=CONTEXT_PARALLEL_TYPES)
    ulysses_size: int = setting(0, "with --context-parallel-type hybrid: cp ranks per all-to-all group")
    tp_comm_overlap: bool = setting(True, "hide each column-parallel layer's input-gradient collective behind its "
                                          "weight gradient", negatable=True)
    moe_a2a_overlap: bool = setting(True, "hide the experts' all-to-alls behind the shared experts and paired chunks", negatable=True)

    def __post_init__(self):
        if self.schedule in V_SHAPED and self.virtual_stages == 1:     # a V has two chunks per rank
            object.__setattr__(self, "virtual_stages", 2)

    @property
    def v_shaped(self) -> bool:
        return self.schedule in V_SHAPED

    def validate(self) -> "ParallelConfig":
        integers(self, "virtual_stages", "ulysses_size")
        positive(self, "bucket_size", "virtual_stages")
        non_negative(self, "ulysses_size")
        self.check_blas()
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
class TrainConfig(DilocoSettings):       # DiLoCo's flags: diloco/settings.py
    SECTION: ClassVar[str] = "training"

    micro_batch_size: int = setting(12)
    global_batch_size: int = setting(0, "default: micro batch x dp", unset=True)   # 0: micro batch x dp
    rampup_batch_size: tuple[int, ...] = setting((), "grow the global batch from START by INCREMENT, evenly over "
                                                     "the first SAMPLES samples (Megatron's semantics)", unset=True,
                                                 count=3, metavar=("START", "INCREMENT", "SAMPLES"))
    max_iters: int = setting(2000)
    eval_interval: int = setting(250)
    eval_iters: int = setting(200)
    warmup_iters: int = setting(100)
    lr_decay_iters: int = setting(0)            # 0: max_iters
    log_interval: int = setting(10)
    save_interval: int = setting(0)             # 0: only on improvement and at the end
    keep_checkpoints: int = setting(2)
    seed: int = setting(1337)
    lr: float = setting(1e-3)
    min_lr: float = setting(1e-4)
    weight_decay: float = setting(0.1)
    grad_clip: float = setting(1.0)             # 0 disables clipping
    beta1: float = setting(0.9)
    beta2: float = setting(0.99)
    eps: float = 1e-8                           # no flag
    precision: str = setting("fp32", "fp32, or bf16 / fp16 / fp8 (linear layers' products in FP8, the rest bf16) "
                                     "with fp32 master weights (docs/07-numbers.md)")
    loss_scale: float = setting(0.0, "initial loss scale, a power of two (0: fp16 starts at 2^16, the others use "
                                     "none)")
    loss_scale_window: int = setting(1000, "fp16: clean steps before the loss scale doubles")
    grad_reduce_dtype: str = setting("fp32", "bf16/fp16: sum gradients over dp in fp32 (4 bytes an element) or in "
                                             "the parameters' format (param: 2 bytes)", choices=GRAD_REDUCE_DTYPES)
    optimizer: str = setting("adamw", "muon: Newton-Schulz-orthogonalised momentum for the blocks' matrices, AdamW "
                                      "for the rest; sgd: p - lr g with AdamW's decoupled weight decay, no "
                                      "momentum", choices=OPTIMIZERS)       # muon/muon.py, optim/sgd.py
    muon_lr: float = setting(0.0, "Muon's peak learning rate (0: --lr)")   # scaled to AdamW's RMS
    muon_momentum: float = setting(0.95)

    def __post_init__(self):
        # A checkpoint's JSON gives a list back; a tuple keeps the config hashable.
        object.__setattr__(self, "rampup_batch_size", tuple(self.rampup_batch_size or ()))

    def validate(self) -> "TrainConfig":
        positive(self, "micro_batch_size", "max_iters", "eval_interval", "eval_iters", "log_interval", "keep_checkpoints")
        non_negative(self, "global_batch_size", "warmup_iters", "lr_decay_iters", "save_interval", "seed")
        finite(self, "lr", "min_lr", "weight_decay", "grad_clip", "beta1", "beta2", "eps")
        non_negative(self, "weight_decay", "grad_clip", "min_lr")
        positive(self, "lr", "eps")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        finite(self, "muon_lr", "muon_momentum")
        non_negative(self, "muon_lr")
        if self.optimizer != "muon" and (self.muon_lr, self.muon_momentum) != (0.0, TrainConfig.muon_momentum):
            raise UserError(f"--muon-lr and --muon-momentum set Muon, and this run uses --optimizer {self.optimizer}")
        if not 0 <= self.muon_momentum < 1:
            raise UserError(f"muon-momentum must lie in [0, 1), got {self.muon_momentum}")
        check_diloco(self)                      # diloco/checks.py
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


def to_dict(cfg) -> dict:
    return asdict(cfg)


def from_dict(cls, values: dict):
    """Build a config from a saved dict, ignoring keys a newer version dropped."""
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})
