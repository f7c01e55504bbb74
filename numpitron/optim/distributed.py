"""What every optimizer of a training run does, whatever it shards.

    grads_ready(params)      the backward reports gradients that are final: an
                             optimizer may start reducing them over dp at once
    step(lr) -> grad norm    finish averaging gradients over dp, clip by the global
                             norm, apply AdamW to the slice [lo, hi) this rank updates
    full_moments()           Adam's m and v laid out like the stage's flat buffer
    load_moments(m, v, t)    the inverse (checkpoints)
    state_nbytes()           bytes of optimizer state on this rank

Subclasses: `parallel.data_parallel.DataParallelOptimizer` (ZeRO stage 0) and
`parallel.zero.ZeroOneOptimizer`; `parallel.optimizer.make_optimizer` picks one.
"""

from numpitron.optim.adamw import AdamW


class DistributedOptimizer:
    zero_stage = None

    def __init__(self, store, topo, train_cfg, lo: int, hi: int):
        self.store, self.topo, self.train_cfg = store, topo, train_cfg
        self.lo, self.hi = lo, hi
        self.adam = AdamW(hi - lo, store.dtype, train_cfg.beta1, train_cfg.beta2,
                          train_cfg.eps, train_cfg.weight_decay)

    def grads_ready(self, params) -> None:
        """Nothing to start early (the default)."""

    def step(self, lr: float) -> float:
        raise NotImplementedError

    def full_moments(self):
        raise NotImplementedError

    def load_moments(self, m_full, v_full, step_count: int) -> None:
        """m and v laid out like the stage's flat buffer: keep this rank's slice."""
        self.adam.load_state(m_full[self.lo:self.hi], v_full[self.lo:self.hi], step_count)

    def state_nbytes(self) -> int:
        return self.adam.state_nbytes
