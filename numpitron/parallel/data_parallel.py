"""Plain data parallelism (ZeRO stage 0): every dp rank keeps the whole optimizer.

Gradients are averaged over the dp group straight from the stage's flat gradient
buffer, in buckets of `bucket_size` elements: a few large all-reduces instead of
one per parameter (and every parameter included, by construction).
"""

from numpitron.optim.adamw import AdamW
from numpitron.optim.grad_norm import clip_, global_grad_norm


def average_gradients(grad, dp_comm, bucket_size: int) -> None:
    for start in range(0, grad.size, bucket_size):
        dp_comm.all_reduce(grad[start:start + bucket_size])
    grad *= 1.0 / dp_comm.size


class DataParallelOptimizer:
    """All-reduce gradients over dp, clip by the global norm, AdamW on the full stage."""

    zero_stage = 0

    def __init__(self, store, topo, train_cfg, bucket_size: int):
        self.store, self.topo, self.cfg, self.bucket_size = store, topo, train_cfg, bucket_size
        self.adam = AdamW(store.size, store.dtype, train_cfg.beta1, train_cfg.beta2,
                          train_cfg.eps, train_cfg.weight_decay)
        self.lo, self.hi = 0, store.size          # the slice of the stage this rank updates

    def step(self, lr: float) -> float:
        """Returns the global gradient norm before clipping."""
        grad = self.store.grad
        average_gradients(grad, self.topo.dp_comm, self.bucket_size)
        # Gradients are now identical across dp: the norm spans one model replica.
        norm = global_grad_norm(grad, self.store.norm_mask, self.topo.model_comm)
        clip_(grad, norm, self.cfg.grad_clip)
        self.adam.update(self.store.data, grad, self.store.decay_mask, lr)
        return norm

    def full_moments(self):
        """Adam's m and v laid out like the stage's flat buffer (for checkpoints)."""
        return self.adam.m, self.adam.v

    def load_moments(self, m_full, v_full, step_count: int) -> None:
        """m and v laid out like the stage's flat buffer: keep this rank's slice."""
        self.adam.load_state(m_full[self.lo:self.hi], v_full[self.lo:self.hi], step_count)

    def state_nbytes(self) -> int:
        return self.adam.state_nbytes
