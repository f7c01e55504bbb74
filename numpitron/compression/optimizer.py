"""Plain data parallelism whose gradients travel compressed, with error feedback
(Seide et al. 2014; Karimireddy et al. 2019): each rank adds the part of its gradient
the last compression dropped back in before compressing again,

    M_w   = g_w + e_w                  this rank's gradient plus its residual
    ĝ     = mean over w of C(M_w)      what the group receives (the compressor's reduce)
    e_w   = M_w - C(M_w)               the new residual: what this rank's message dropped

so nothing is lost, only late. Summed over T steps, the updates' gradients telescope:

    sum over t of ĝ_t + mean over w of e_w(T) = sum over t of mean over w of g_w(t)

(tests/test_compression.py holds the code to it in float64). The residual is this
rank's own (it differs from rank to rank), kept with the compressor's state (PowerSGD's
Q) for checkpoints (`rank_state`, saved per rank: checkpoint/rank_state.py).

The reduction runs after the backward, in one call (as the hierarchical all-reduce
does), not bucket by bucket during it: PowerSGD needs every matrix's first all-reduce
back before it can compute what the second sends.
"""

from dataclasses import replace

import numpy as np

from numpitron.compression.int8 import Int8
from numpitron.compression.powersgd import PowerSGD
from numpitron.data_parallel.buckets import DataParallelOptimizer


def make_compressor(method: str, store, parallel_cfg, seed: int):
    if method == "int8":
        return Int8(store)
    return PowerSGD(store, parallel_cfg.powersgd_rank, seed)


class CompressedDataParallelOptimizer(DataParallelOptimizer):
    def __init__(self, store, topo, train_cfg, parallel_cfg, group=None, precision=None):
        super().__init__(store, topo, train_cfg, replace(parallel_cfg, overlap_grad_reduce=False), group, precision)
        self.compressor = make_compressor(parallel_cfg.grad_compression, store, parallel_cfg, train_cfg.seed)
        self.residual = np.zeros(store.size, store.dtype)        # e_w

    def reduce_grads(self) -> None:
        grads = self.store.grad
        grads += self.residual                                   # M_w = g_w + e_w
        mean, own = self.compressor.reduce(grads, self.group.comm, self.group.batch_ranks)
        np.subtract(grads, own, out=self.residual)              # e_w = M_w - C(M_w)
        grads[...] = mean

    def kept_grads(self) -> list[np.ndarray]:
        return super().kept_grads() + [self.residual]

    def rank_state(self) -> dict:
        """What this rank alone keeps between steps: its residual, the compressor's state."""
        return {"residual": self.residual, **self.compressor.state()}

    def load_rank_state(self, arrays: dict) -> None:
        self.residual[...] = arrays["residual"]
        self.compressor.load(arrays)
