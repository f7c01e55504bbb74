"""One training step on any mesh, and evaluation.

The steps, in the order of DESIGN.md:
  1. the global batch of iteration i is a pure function of (seed, i), whatever dp;
     this dp rank takes its rows and cuts them into micro-batches;
  2. a schedule runs the micro-batches through this pipeline stage (with pp = 1
     the plain accumulation loop), each loss weighted 1/m;
  3. the tied embedding's gradient is summed over the first and last stage;
  4. the optimizer averages gradients over dp (all-reduce, or ZeRO-1's
     reduce-scatter), clips by the global norm, and applies AdamW.
"""

import numpy as np

from numpitron.data.batches import global_batch
from numpitron.model import GPTStage
from numpitron.optim.schedule import learning_rate
from numpitron.parallel.pipeline import forward_only, run_schedule, sync_tied_embedding
from numpitron.parallel.zero import make_optimizer


class Trainer:
    def __init__(self, model_cfg, parallel_cfg, train_cfg, topo):
        self.model_cfg, self.parallel_cfg, self.cfg, self.topo = model_cfg, parallel_cfg, train_cfg, topo
        self.num_microbatches = train_cfg.num_microbatches(topo.dp)
        self.global_batch_size = train_cfg.global_batch(topo.dp)
        pad = topo.dp if parallel_cfg.zero_stage == 1 else 1
        self.model = GPTStage(model_cfg, topo, seed=train_cfg.seed, pad_multiple=pad)
        self.optimizer = make_optimizer(self.model.store, topo, train_cfg, parallel_cfg)
        self.iteration = 0          # number of completed optimizer steps
        self.best_val_loss = float("inf")

    def microbatches(self, tokens, stream: str, index: int):
        """This dp rank's share of global batch `index` of `stream`, as micro-batches."""
        x, y = global_batch(tokens, self.cfg.seed, stream, index, self.global_batch_size, self.model_cfg.seq_len)
        per_rank = self.global_batch_size // self.topo.dp
        start = self.topo.dp_rank * per_rank
        mb = self.cfg.micro_batch_size
        return [(x[s:s + mb], y[s:s + mb]) for s in range(start, start + per_rank, mb)]

    def lr(self, iteration: int) -> float:
        c = self.cfg
        return learning_rate(iteration, c.lr, c.min_lr, c.warmup_iters, c.lr_decay_iters or c.max_iters)

    def train_step(self, train_tokens) -> dict:
        """Iteration `self.iteration`: returns loss, lr, grad_norm (same on every rank)."""
        self.model.store.zero_grad()
        batches = self.microbatches(train_tokens, "train", self.iteration)
        losses, stats = run_schedule(self.model, self.topo, batches, self.parallel_cfg.schedule,
                                     loss_weight=1.0 / self.num_microbatches)
        sync_tied_embedding(self.model, self.topo)
        lr = self.lr(self.iteration)
        grad_norm = self.optimizer.step(lr)
        self.iteration += 1
        self.last_pipeline_stats = stats
        return {"train_loss": self.mean_loss(losses), "lr": lr, "grad_norm": grad_norm}

    def mean_loss(self, losses) -> float:
        """Average the last stage's micro-batch losses over dp, then tell every stage."""
        buf = np.array([np.mean(losses) if self.model.last else 0.0])
        self.topo.dp_comm.all_reduce(buf)
        buf /= self.topo.dp
        self.topo.pp_comm.broadcast(buf, root=self.topo.pp - 1)
        return float(buf[0])

    def evaluate(self, splits: dict, eval_iters: int) -> dict:
        """Mean loss over `eval_iters` fixed global batches of each split."""
        out = {}
        for name, tokens in splits.items():
            losses = []
            for k in range(eval_iters):
                losses += forward_only(self.model, self.topo, self.microbatches(tokens, f"eval-{name}", k))
            out[name] = self.mean_loss(losses)
        return out
