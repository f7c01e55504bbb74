"""Expert parallelism's two all-to-alls: tokens travel to the ranks of their experts
(dispatch) and their outputs come back (combine), over the ep group (GShard, Lepikhin
et al. 2020, §2.2; Megatron-LM's all-to-all token dispatcher).

The ep ranks split the E experts into equal contiguous parts: rank r holds experts
r*E/ep .. (r+1)*E/ep - 1. A rank sends its tokens sorted by expert, so the rows for
each destination are contiguous. How many rows will arrive from whom is not known in
advance (it is whatever the routers chose), so the counts go first, in a small
all-to-all of E integers, then the rows in an `Alltoallv`. What arrives is grouped by
source rank; the local experts want it grouped by expert, so it is reordered.

The backward of an all-to-all is the all-to-all the other way with the same counts:
the gradient of the combine travels like a dispatch, the gradient of the dispatch
like a combine. With ep = 1 both are copies.

Each can also be started and finished apart (`start_dispatch`, `start_combine`: an
`Ialltoallv`), so that the layer computes something else while the rows travel
(experts/moe.py), and, before each wait, `meanwhile` lets a paired chunk compute
(chunk_pairing/; outside a pair it does nothing); before each start, `before_start`
lets the pair finish the other chunk's all-to-alls first.
"""

from typing import NamedTuple

import numpy as np

from numpitron.distributed.sharding import shard_size


class Plan(NamedTuple):
    """One micro-batch's traffic, known after the counts are exchanged."""
    send_rows: np.ndarray        # (ep,) rows this rank sends to each ep rank
    recv_rows: np.ndarray        # (ep,) rows it receives from each
    order: np.ndarray            # received rows (grouped by source) -> grouped by local expert
    expert_rows: np.ndarray      # (E/ep,) rows for each local expert


class AllToAllDispatcher:
    def __init__(self, ep_comm, num_experts: int, overlap: bool = True):
        """overlap=False: a started all-to-all is waited for at once (blocking, as before)."""
        self.ep, self.overlap, self.meanwhile = ep_comm, overlap, lambda comm, pending: None
        self.before_start = lambda: None
        self.local_experts = shard_size(num_experts, ep_comm.size)

    def plan(self, rows_per_expert: np.ndarray) -> Plan:
        """rows_per_expert: (E,) rows this rank sends to each expert."""
        send = np.ascontiguousarray(rows_per_expert.reshape(self.ep.size, self.local_experts), np.int64)
        recv = self.ep.all_to_all(send)              # recv[s, e]: rows from rank s for local expert e
        start = (np.cumsum(recv.reshape(-1)) - recv.reshape(-1)).reshape(recv.shape)
        order = np.concatenate([np.arange(start[s, e], start[s, e] + recv[s, e])
                                for e in range(self.local_experts) for s in range(self.ep.size)]
                               + [np.zeros(0, np.int64)]).astype(np.int64)
        return Plan(send.sum(axis=1), recv.sum(axis=1), order, recv.sum(axis=0))

    def dispatch(self, rows: np.ndarray, plan: Plan) -> np.ndarray:
        """Rows sorted by expert, from this rank -> the rows of this rank's experts from
        every ep rank, grouped by local expert (`combine` is the inverse)."""
        return self.start_dispatch(rows, plan)()

    def combine(self, rows: np.ndarray, plan: Plan) -> np.ndarray:
        return self.start_combine(rows, plan)()

    def start_dispatch(self, rows: np.ndarray, plan: Plan):
        """`dispatch`, started: returns the function that waits for it and returns its rows."""
        self.before_start()
        received, pending = self.ep.iall_to_allv(np.ascontiguousarray(rows), plan.send_rows, plan.recv_rows)
        return self._finish(lambda: self._arrived(pending, received)[plan.order])

    def start_combine(self, rows: np.ndarray, plan: Plan):
        """`combine`, started: returns the function that waits for it and returns its rows."""
        by_source = np.empty_like(rows)
        by_source[plan.order] = rows
        self.before_start()
        received, pending = self.ep.iall_to_allv(by_source, plan.recv_rows, plan.send_rows)
        return self._finish(lambda: self._arrived(pending, received))

    def _finish(self, arrive):
        if self.overlap:
            return arrive
        rows = arrive()
        return lambda: rows

    def _arrived(self, pending, received: np.ndarray) -> np.ndarray:
        self.meanwhile(self.ep, pending)
        self.ep.wait(pending)
        return received
