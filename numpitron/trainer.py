"""One training step on any mesh, and evaluation.

The steps (docs/architecture.md, "One training step"):
  1. the global batch of iteration i is a pure function of (seed, i), whatever dp;
     this dp rank takes its rows and cuts them into micro-batches;
  2. a schedule runs the micro-batches through this pipeline stage (with pp = 1
     the plain accumulation loop), each loss weighted 1/m; during the last
     micro-batch's backward the optimizer hears which gradients are final and may
     start reducing them over dp;
  3. the model finalizes its gradients: the tied embedding's is summed over the
     stages holding the first and the last virtual stage;
  4. the optimizer finishes averaging gradients over dp (all-reduce, or ZeRO-1's
     reduce-scatter), clips by the global norm, and applies AdamW. (A model with
     experts has two stores and two optimizers, stepped together: one norm.)

The trainer is given what it steps, built (build.py builds all of it from the configs):
the stage, its optimizers, the rule that steps them (`PlainStep` below; a mixed-precision
run's scales the loss and skips overflowing steps, precision/mixed_step.py) and the
features that act around each step (`StepFeature`: FP8's amax histories, the experts'
routing statistics), none of which the step itself knows.
"""

from typing import NamedTuple

import numpy as np

from numpitron.context_parallel.zigzag import local_positions
from numpitron.data.batches import global_batch
from numpitron.data_parallel.distributed_optimizer import step_together
from numpitron.distributed.agree import on_every_rank
from numpitron.distributed.sharding import shard_bounds
from numpitron.optim.schedule import learning_rate
from numpitron.pipeline_parallel.executor import check_backward_splits, forward_only, run_schedule


class PlainStep:
    """How the optimizers step when no feature changes it: the loss as it is, every step
    applied (`step_together`)."""

    loss_scale = 1.0

    def step(self, optimizers, lr: float) -> float:
        return step_together(optimizers, lr)

    def metrics(self) -> dict:
        return {}


class Readers(NamedTuple):
    """The ranks that split each global batch's rows, and this rank's place among them:
    the dp ranks (DiLoCo's replicas read theirs side by side: diloco/feature.py)."""
    count: int
    index: int


class StepFeature:
    """Something that acts around every step without the step knowing it: before the
    micro-batches run, once the gradients are final, on the step's metrics, and on an
    evaluation's losses."""

    def begin_step(self, trainer) -> None:
        pass

    def end_backward(self, trainer) -> None:
        pass

    def end_step(self, trainer, out: dict) -> None:
        pass

    def end_evaluate(self, trainer, out: dict) -> None:
        pass


class Trainer:
    """Configs as `cli.setup_training` validated them, on any Topology; the stage and its
    optimizers as build.py builds them."""

    def __init__(self, model_cfg, parallel_cfg, train_cfg, topo, model, optimizers, step_rule=None, features=(),
                 readers: Readers | None = None):
        self.model_cfg, self.parallel_cfg, self.train_cfg, self.topo = model_cfg, parallel_cfg, train_cfg, topo
        self.model = model
        # Every rank learns if any stage holds a layer the schedule cannot run.
        on_every_rank(topo.world, lambda: check_backward_splits(self.model, parallel_cfg.schedule))
        # One per store of the model; `optimizer` is the dense parameters' (the only one
        # without experts).
        self.optimizers, self.optimizer = optimizers, optimizers[0]
        self.step_rule = step_rule or PlainStep()
        self.features = list(features)
        self.readers = readers or Readers(topo.dp, topo.dp_rank)
        self.fp8 = None             # FP8's delayed scaling, when a feature (build.py)
        self.scaler = None          # the loss scaler a checkpoint keeps (build.py)
        self.run_schedule = run_schedule    # or one that runs the schedule's pairs as pairs (build.py)
        self.iteration = 0          # number of completed optimizer steps
        self.best_val_loss = float("inf")
        self.eval_batch_size = train_cfg.global_batch(self.readers.count)   # evaluation: always the full batch
        self.set_batch(0)

    def set_batch(self, iteration: int) -> None:
        """The global batch of `iteration` (it grows during a ramp-up: --rampup-batch-size)
        and so the micro-batches per dp rank, whose losses the schedule weights 1/m."""
        readers = self.readers.count
        self.global_batch_size = self.train_cfg.global_batch_at(iteration, readers)
        self.num_microbatches = self.global_batch_size // (self.train_cfg.micro_batch_size * readers)
        self.model.loss_weight = 1.0 / self.num_microbatches

    def microbatches(self, tokens, stream: str, index: int, batch_size: int | None = None):
        """This rank's share of global batch `index` of `stream` (of the step's size unless
        told), as micro-batches: the rows of its place among the readers (its dp rank),
        and of each row the cp rank's tokens (context_parallel/zigzag.py)."""
        topo, batch_size = self.topo, batch_size or self.global_batch_size
        x, y = global_batch(tokens, self.train_cfg.seed, stream, index, batch_size, self.model_cfg.seq_len)
        mine = local_positions(self.model_cfg.seq_len, topo.cp, topo.cp_rank)
        x, y = x[:, mine], y[:, mine]
        start, stop = shard_bounds(batch_size, *self.readers)
        mb = self.train_cfg.micro_batch_size
        return [(x[s:s + mb], y[s:s + mb]) for s in range(start, stop, mb)]

    def lr(self, iteration: int) -> float:
        c = self.train_cfg
        return learning_rate(iteration, c.lr, c.min_lr, c.warmup_iters, c.lr_decay_iters or c.max_iters)

    def train_step(self, train_tokens) -> dict:
        """Iteration `self.iteration`: returns loss, lr, grad_norm (same on every rank)."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        for feature in self.features:
            feature.begin_step(self)
        self.set_batch(self.iteration)
        batches = self.microbatches(train_tokens, "train", self.iteration)
        losses, stats = self.run_schedule(self.model, self.topo, batches, self.parallel_cfg.schedule,
                                     loss_weight=self.model.loss_weight * self.step_rule.loss_scale,
                                     grads_ready=self.grads_ready)
        self.model.finalize_grads(self.grads_ready)
        for feature in self.features:
            feature.end_backward(self)
        lr = self.lr(self.iteration)
        grad_norm = self.step_rule.step(self.optimizers, lr)
        self.iteration += 1
        self.last_pipeline_stats = stats
        out = {"train_loss": self.mean_loss(losses), "lr": lr, "grad_norm": grad_norm, **self.step_rule.metrics()}
        for feature in self.features:
            feature.end_step(self, out)
        return out

    def grads_ready(self, params) -> None:
        for optimizer in self.optimizers:
            optimizer.grads_ready(params)

    def mean_loss(self, losses) -> float:
        """Average the micro-batch losses of the stage holding the head over dp and cp
        (every rank's losses are means over the same number of tokens), then tell every
        stage."""
        buf = np.array([np.mean(losses) if self.model.last else 0.0])
        self.topo.dp_cp_comm.all_reduce(buf)
        buf /= self.topo.dp_cp
        self.topo.pp_comm.broadcast(buf, root=self.model.head_rank)
        return float(buf[0])

    def evaluate(self, splits: dict, eval_iters: int) -> dict:
        """Mean loss over `eval_iters` fixed global batches of each split."""
        out = {}
        for name, tokens in splits.items():
            losses = []
            for k in range(eval_iters):
                losses += forward_only(self.model, self.topo,
                                       self.microbatches(tokens, f"eval-{name}", k, self.eval_batch_size),
                                       self.parallel_cfg.schedule)
            out[name] = self.mean_loss(losses)
        for feature in self.features:
            feature.end_evaluate(self, out)
        return out
