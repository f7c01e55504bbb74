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
from numpitron.data_parallel.zero import ZeroOneOptimizer


def make_compressor(method: str, store, parallel_cfg, seed: int):
    if method == "int8":
        return Int8(store)
    return PowerSGD(store, parallel_cfg.powersgd_rank, seed)


class ErrorFeedback:
    """The compressed reduction with its residual, for a data-parallel optimizer (ZeRO-0)
    or ZeRO-1's, which differ only in where the mean gradient goes."""

    def start_feedback(self, store, parallel_cfg, seed: int) -> None:
        self.compressor = make_compressor(parallel_cfg.grad_compression, store, parallel_cfg, seed)
        self.residual = np.zeros(store.size, store.dtype)        # e_w

    def compressed_mean(self) -> np.ndarray:
        """The mean over the group of every rank's C(M_w), the whole buffer; keeps e_w."""
        grads = self.store.grad
        grads += self.residual                                   # M_w = g_w + e_w
        mean, own = self.compressor.reduce(grads, self.group.comm, self.group.batch_ranks)
        np.subtract(grads, own, out=self.residual)              # e_w = M_w - C(M_w)
        return mean

    def kept_grads(self) -> list[np.ndarray]:
        return super().kept_grads() + [self.residual]

    def rank_state(self) -> dict:
        """What this rank alone keeps between steps: its residual, the compressor's state."""
        return {"residual": self.residual, **self.compressor.state()}

    def load_rank_state(self, arrays: dict) -> None:
        self.residual[...] = arrays["residual"]
        self.compressor.load(arrays)


class CompressedDataParallelOptimizer(ErrorFeedback, DataParallelOptimizer):
    def __init__(self, store, topo, train_cfg, parallel_cfg, group=None, precision=None):
        super().__init__(store, topo, train_cfg, replace(parallel_cfg, overlap_grad_reduce=False), group, precision)
        self.start_feedback(store, parallel_cfg, train_cfg.seed)

    def reduce_grads(self) -> None:
        self.store.grad[...] = self.compressed_mean()


class CompressedZeroOneOptimizer(ErrorFeedback, ZeroOneOptimizer):
    """ZeRO-1 keeps the whole gradient on every rank until it reduces: the compressed
    mean replaces its reduce-scatter, and the rank keeps its slice of it. The update and
    the parameters' all-gather are ZeRO-1's (data_parallel/zero.py)."""

    def __init__(self, store, topo, train_cfg, parallel_cfg, group=None, precision=None):
        super().__init__(store, topo, train_cfg, parallel_cfg, group, precision)
        self.start_feedback(store, parallel_cfg, train_cfg.seed)

    def reduce_grads(self) -> None:
        self.owned.grads[...] = self.compressed_mean()[self.owned.lo:self.owned.hi]
