"""One training step on any mesh, and evaluation.

The steps (docs/architecture.md, "One training step"):
  1. the global batch of iteration i is a pure function of (seed, i), whatever dp;
     this dp rank takes its rows and cuts them into micro-batches;
  2. a schedule runs the micro-batches through this pipeline stage (with pp = 1
     the plain accumulation loop), each loss weighted 1/m; during the last
     micro-batch's backward the optimizer hears which gradients are final and may
     start reducing them over dp;
  3. the model finalizes its gradients: the tied embedding's is summed over the
     first and last stage;
  4. the optimizer finishes averaging gradients over dp (all-reduce, or ZeRO-1's
     reduce-scatter), clips by the global norm, and applies AdamW.
"""

import numpy as np

from numpitron.data.batches import global_batch
from numpitron.distributed.agree import on_every_rank
from numpitron.model import GPTStage
from numpitron.optim.schedule import learning_rate
from numpitron.parallel.context import local_positions
from numpitron.parallel.optimizer import make_optimizer
from numpitron.parallel.pipeline import check_backward_splits, forward_only, run_schedule


class Trainer:
    """Configs as `cli.setup_training` validated them, on any Topology."""

    def __init__(self, model_cfg, parallel_cfg, train_cfg, topo):
        self.model_cfg, self.parallel_cfg, self.train_cfg, self.topo = model_cfg, parallel_cfg, train_cfg, topo
        self.num_microbatches = train_cfg.num_microbatches(topo.dp)
        self.global_batch_size = train_cfg.global_batch(topo.dp)
        self.model = GPTStage(model_cfg, topo, seed=train_cfg.seed, sequence_parallel=parallel_cfg.sequence_parallel,
                              recompute=parallel_cfg.recompute, virtual_stages=parallel_cfg.virtual_stages)
        # Every rank learns if any stage holds a layer the schedule cannot run.
        on_every_rank(topo.world, lambda: check_backward_splits(self.model, parallel_cfg.schedule))
        self.optimizer = make_optimizer(self.model.store, topo, train_cfg, parallel_cfg)
        self.iteration = 0          # number of completed optimizer steps
        self.best_val_loss = float("inf")

    def microbatches(self, tokens, stream: str, index: int):
        """This rank's share of global batch `index` of `stream`, as micro-batches: the
        dp rank's rows, and of each row the cp rank's tokens (parallel/context.py)."""
        topo = self.topo
        x, y = global_batch(tokens, self.train_cfg.seed, stream, index, self.global_batch_size,
                            self.model_cfg.seq_len)
        mine = local_positions(self.model_cfg.seq_len, topo.cp, topo.cp_rank)
        x, y = x[:, mine], y[:, mine]
        per_rank = self.global_batch_size // topo.dp
        start = topo.dp_rank * per_rank
        mb = self.train_cfg.micro_batch_size
        return [(x[s:s + mb], y[s:s + mb]) for s in range(start, start + per_rank, mb)]

    def lr(self, iteration: int) -> float:
        c = self.train_cfg
        return learning_rate(iteration, c.lr, c.min_lr, c.warmup_iters, c.lr_decay_iters or c.max_iters)

    def train_step(self, train_tokens) -> dict:
        """Iteration `self.iteration`: returns loss, lr, grad_norm (same on every rank)."""
        self.model.store.zero_grad()
        batches = self.microbatches(train_tokens, "train", self.iteration)
        losses, stats = run_schedule(self.model, self.topo, batches, self.parallel_cfg.schedule,
                                     loss_weight=1.0 / self.num_microbatches,
                                     grads_ready=self.optimizer.grads_ready)
        self.model.finalize_grads(self.optimizer.grads_ready)
        lr = self.lr(self.iteration)
        grad_norm = self.optimizer.step(lr)
        self.iteration += 1
        self.last_pipeline_stats = stats
        return {"train_loss": self.mean_loss(losses), "lr": lr, "grad_norm": grad_norm}

    def mean_loss(self, losses) -> float:
        """Average the last stage's micro-batch losses over dp and cp (every rank's
        losses are means over the same number of tokens), then tell every stage."""
        buf = np.array([np.mean(losses) if self.model.last else 0.0])
        self.topo.dp_cp_comm.all_reduce(buf)
        buf /= self.topo.dp_cp
        self.topo.pp_comm.broadcast(buf, root=self.topo.pp - 1)
        return float(buf[0])

    def evaluate(self, splits: dict, eval_iters: int) -> dict:
        """Mean loss over `eval_iters` fixed global batches of each split."""
        out = {}
        for name, tokens in splits.items():
            losses = []
            for k in range(eval_iters):
                losses += forward_only(self.model, self.topo, self.microbatches(tokens, f"eval-{name}", k),
                                       self.parallel_cfg.schedule)
            out[name] = self.mean_loss(losses)
        return out
