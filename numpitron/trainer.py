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
"""

import numpy as np

from numpitron.build import build_stage
from numpitron.context_parallel.zigzag import local_positions
from numpitron.data.batches import global_batch
from numpitron.data_parallel.distributed_optimizer import step_together
from numpitron.distributed.agree import on_every_rank
from numpitron.distributed.sharding import shard_bounds
from numpitron.experts.router import update_balance_bias
from numpitron.optim.factory import make_optimizers
from numpitron.optim.schedule import learning_rate
from numpitron.pipeline_parallel.executor import check_backward_splits, forward_only, run_schedule
from numpitron.precision.formats import FORMATS, LossScaler, use_format
from numpitron.precision.fp8 import DelayedScaling, linear_layers
from numpitron.precision.master_weights import step_mixed


class Trainer:
    """Configs as `cli.setup_training` validated them, on any Topology."""

    def __init__(self, model_cfg, parallel_cfg, train_cfg, topo):
        self.model_cfg, self.parallel_cfg, self.train_cfg, self.topo = model_cfg, parallel_cfg, train_cfg, topo
        self.num_microbatches = train_cfg.num_microbatches(topo.dp)
        self.global_batch_size = train_cfg.global_batch(topo.dp)
        self.model = build_stage(model_cfg, topo, seed=train_cfg.seed, sequence_parallel=parallel_cfg.sequence_parallel,
                                 recompute=parallel_cfg.recompute, loss_weight=1.0 / self.num_microbatches,
                                 virtual_stages=parallel_cfg.virtual_stages, v_shape=parallel_cfg.v_shaped,
                                 tp_comm_overlap=parallel_cfg.tp_comm_overlap)
        self.eval_batch_size = self.global_batch_size       # evaluation always takes the full batch
        # Every rank learns if any stage holds a layer the schedule cannot run.
        on_every_rank(topo.world, lambda: check_backward_splits(self.model, parallel_cfg.schedule))
        # One per store of the model; `optimizer` is the dense parameters' (the only one
        # without experts).
        self.optimizers = make_optimizers(self.model, topo, train_cfg, parallel_cfg)
        self.optimizer = self.optimizers[0]
        self.optimizer.install(self.model)         # ZeRO-3 gathers each layer while it runs
        # Mixed precision (docs/16-numbers.md): activations rounded between layers,
        # gradients rounded, unscaled and checked by `step_mixed`.
        self.precision = FORMATS[train_cfg.precision]
        use_format(self.model, self.precision)
        self.scaler = LossScaler(self.precision, train_cfg.loss_scale, train_cfg.loss_scale_window)
        # FP8: the linear layers' products take per-tensor scales from amax histories.
        self.fp8 = DelayedScaling(list(linear_layers(self.model)), topo.world) if self.precision.fp8_matmuls else None
        if self.fp8:
            self.fp8.install(linear_layers(self.model))
        self.iteration = 0          # number of completed optimizer steps
        self.best_val_loss = float("inf")
        self.set_batch(0)

    def set_batch(self, iteration: int) -> None:
        """The global batch of `iteration` (it grows during a ramp-up: --rampup-batch-size)
        and so the micro-batches per dp rank, whose losses the schedule weights 1/m."""
        self.global_batch_size = self.train_cfg.global_batch_at(iteration, self.topo.dp)
        self.num_microbatches = self.global_batch_size // (self.train_cfg.micro_batch_size * self.topo.dp)
        self.model.loss_weight = 1.0 / self.num_microbatches

    def microbatches(self, tokens, stream: str, index: int, batch_size: int | None = None):
        """This rank's share of global batch `index` of `stream` (of the step's size unless
        told), as micro-batches: the dp rank's rows, and of each row the cp rank's tokens
        (context_parallel/zigzag.py)."""
        topo, batch_size = self.topo, batch_size or self.global_batch_size
        x, y = global_batch(tokens, self.train_cfg.seed, stream, index, batch_size, self.model_cfg.seq_len)
        mine = local_positions(self.model_cfg.seq_len, topo.cp, topo.cp_rank)
        x, y = x[:, mine], y[:, mine]
        start, stop = shard_bounds(batch_size, topo.dp, topo.dp_rank)
        mb = self.train_cfg.micro_batch_size
        return [(x[s:s + mb], y[s:s + mb]) for s in range(start, stop, mb)]

    def lr(self, iteration: int) -> float:
        c = self.train_cfg
        return learning_rate(iteration, c.lr, c.min_lr, c.warmup_iters, c.lr_decay_iters or c.max_iters)

    def train_step(self, train_tokens) -> dict:
        """Iteration `self.iteration`: returns loss, lr, grad_norm (same on every rank)."""
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        if self.model.experts:
            self.model.experts.log.reset()
        self.set_batch(self.iteration)
        batches = self.microbatches(train_tokens, "train", self.iteration)
        mixed = self.precision.mixed
        if self.fp8:
            self.fp8.begin_step()
        loss_weight = self.model.loss_weight * (self.scaler.scale if mixed else 1.0)
        losses, stats = run_schedule(self.model, self.topo, batches, self.parallel_cfg.schedule,
                                     loss_weight=loss_weight, grads_ready=self.grads_ready)
        self.model.finalize_grads(self.grads_ready)
        if self.fp8:
            self.fp8.end_step()
        lr = self.lr(self.iteration)
        grad_norm = step_mixed(self.optimizers, lr, self.scaler) if mixed else step_together(self.optimizers, lr)
        self.iteration += 1
        self.last_pipeline_stats = stats
        out = {"train_loss": self.mean_loss(losses), "lr": lr, "grad_norm": grad_norm}
        if mixed:
            out.update(self.scaler.state())
        if self.model_cfg.num_experts:
            out.update(self.routing_metrics())
            out["train_loss"] += out["moe_aux_loss"]
            if self.model_cfg.moe_load_balancing == "bias":      # from this step's global load
                update_balance_bias(self.model.experts.bias, self.model.experts.log.tokens,
                                    self.model_cfg.moe_bias_update_rate)
        return out

    def grads_ready(self, params) -> None:
        for optimizer in self.optimizers:
            optimizer.grads_ready(params)

    def routing_metrics(self) -> dict:
        """The iteration's routing, summed over every rank's micro-batches (each stage
        knows its own blocks): the aux loss as it enters the objective (mean over
        micro-batches, summed over blocks), the dropped share of assignments, the
        assignments each expert of each MoE block was chosen for, and each block's
        balance: its busiest expert's load over the mean load. After the reduction the
        counts are the global ones on every rank: each stage's blocks summed over pp,
        every rank that routes over dp and cp (ep lies inside dp; tp ranks route alike)."""
        log, topo, c = self.model.experts.log, self.topo, self.model_cfg
        buf = log.vector()
        topo.dp_cp_comm.all_reduce(buf)
        topo.pp_comm.all_reduce(buf)
        log.from_vector(buf)
        moe_blocks = [i for i in range(c.n_layers) if c.is_moe_block(i)]
        load = log.tokens[moe_blocks]
        assigned = load.sum()
        return {"moe_aux_loss": float(log.aux_loss.sum()) / (self.num_microbatches * topo.dp_cp),
                "moe_dropped_fraction": float(log.dropped.sum() / assigned),
                "moe_tokens_per_expert": load.astype(int).tolist(),
                "moe_max_over_mean_load": (load.max(axis=1) / load.mean(axis=1)).tolist()}

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
        return out
