"""Muon on a mesh: every hidden matrix is orthogonalised whole, on one owner rank.

A matrix W of a stage is spread over two axes of the mesh: tensor parallelism splits it
into tp shards (along its split axis), and ZeRO cuts each shard's range of the flat
buffer where the ranks' 1/g slices fall (g = dp x cp; without ZeRO every replica holds
the whole shard and g counts as 1). Newton-Schulz needs all of W at once, so per step:

  1. gather over the ZeRO group: each shard's pieces to the owner's ZeRO rank;
  2. gather over tp: the shards to the owner, which now holds W whole;
  3. the owner iterates (muon/muon.py);
  4. scatter over tp, 5. scatter over the ZeRO group: each rank receives the update of
     exactly the elements it holds, and applies it there.

Owners are spread over the tp x g ranks of a stage, the largest matrix first to the
least loaded rank (by elements), so the iterations run in parallel. Each phase uses
one kind of communicator in the same matrix order on every rank, so the blocking
collectives cannot wait on each other in a cycle.

Bytes (docs/10-muon.md): an element travels to its owner and its update back,
one hop per axis on which it is not already at the owner. Summed over the stage's ranks,
for matrices of E_k elements whose owner's ZeRO slice holds c_k elements of each shard:

    bytes = 2 b sum_k [ (E_k - tp c_k) + E_k (tp - 1) / tp ]

(the first term the ZeRO hop, the second the tp hop; b bytes per element).
"""

import numpy as np

from numpitron.distributed.comm import Comm
from numpitron.distributed.sharding import pieces_of_range
from numpitron.muon.muon import Muon, matrix_pieces, orthogonalised


def balanced_owners(sizes: list[int], ranks: int) -> list[int]:
    """The owner of each matrix: largest first, each to the rank with the fewest
    elements so far (ties: the lowest rank). The same answer on every rank."""
    load, owners = [0] * ranks, [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[k], load[owner] = owner, load[owner] + sizes[k]
    return owners


class MatrixOwners:
    """The `orthogonalise` function Muon calls on a mesh, for one store's slice [lo, hi)
    held by this rank; `shards` is the ZeRO group (a size-1 Comm without ZeRO)."""

    def __init__(self, store, lo: int, hi: int, tp: Comm, shards: Comm):
        self.tp, self.shards, self.size, self.dtype = tp, shards, store.size, store.dtype
        self.pieces = matrix_pieces(store, lo, hi)
        owners = balanced_owners([int(np.prod(p.shape)) for p in self.pieces], tp.size * shards.size)
        # Owner o is tp rank o % tp on ZeRO rank o // tp: tp fastest, as in the mesh.
        self.owner = [(o % tp.size, o // tp.size) for o in owners]

    def owner_counts(self) -> list[int]:
        """c_k of the bytes formula: elements of matrix k's shard in its owner's ZeRO slice."""
        return [pieces_of_range(p.a, p.b, self.size, self.shards.size)[d] for p, (_, d) in zip(self.pieces, self.owner)]

    def __call__(self, u: np.ndarray) -> np.ndarray:
        """u: this rank's pieces of every hidden matrix, packed (Muon's momentum with
        Nesterov's look-ahead). Returns their pieces of the scaled update. Collective over
        tp and the ZeRO group."""
        tp, shards = self.tp, self.shards
        shard_of, whole = {}, {}
        for k, piece in enumerate(self.pieces):                              # 1. ZeRO slices -> shard
            t_owner, d_owner = self.owner[k]
            counts = pieces_of_range(piece.a, piece.b, self.size, shards.size)
            shard_of[k] = np.empty(piece.b - piece.a, u.dtype) if shards.rank == d_owner else None
            shards.gatherv(u[piece.offset:piece.offset + piece.count], shard_of[k], counts, root=d_owner)
        for k, piece in enumerate(self.pieces):                              # 2. tp shards -> matrix
            t_owner, d_owner = self.owner[k]
            if shards.rank == d_owner:
                whole[k] = self._gather_over_tp(piece.param, shard_of[k], t_owner)
        for k, piece in enumerate(self.pieces):                              # 3. iterate
            if self.owner[k] == (tp.rank, shards.rank):
                whole[k] = orthogonalised(whole[k], piece.shape).reshape(piece.param.full_shape)
        out = np.empty_like(u)
        for k, piece in enumerate(self.pieces):                              # 4. matrix -> tp shards
            t_owner, d_owner = self.owner[k]
            if shards.rank == d_owner:
                shard_of[k] = self._scatter_over_tp(piece.param, whole.get(k), t_owner)
        for k, piece in enumerate(self.pieces):                              # 5. shard -> ZeRO slices
            t_owner, d_owner = self.owner[k]
            counts = pieces_of_range(piece.a, piece.b, self.size, shards.size)
            shards.scatterv(shard_of[k], out[piece.offset:piece.offset + piece.count], counts, root=d_owner)
        return out

    def _gather_over_tp(self, param, shard: np.ndarray, root: int):
        """The whole logical matrix on tp rank `root` (None elsewhere). A tp-replicated
        parameter is whole on every tp rank already."""
        if param.split_axis is None:
            return shard.reshape(param.full_shape) if self.tp.rank == root else None
        moved = np.ascontiguousarray(np.moveaxis(shard.reshape(param.local_shape), param.split_axis, 0))
        stacked = np.empty(self.tp.size * moved.size, shard.dtype) if self.tp.rank == root else None
        self.tp.gatherv(moved.reshape(-1), stacked, [moved.size] * self.tp.size, root=root)
        if stacked is None:
            return None
        return np.moveaxis(stacked.reshape((self.tp.size * moved.shape[0],) + moved.shape[1:]), 0, param.split_axis)

    def _scatter_over_tp(self, param, whole, root: int) -> np.ndarray:
        """This tp rank's shard of the update, flat in its tp-local layout."""
        if param.split_axis is None:
            shard = np.empty(int(np.prod(param.full_shape)), self.dtype)
            if self.tp.rank == root:
                shard[...] = whole.reshape(-1)
            return self.tp.broadcast(shard, root=root)
        local = param.local_shape
        moved_shape = (local[param.split_axis],) + tuple(n for i, n in enumerate(local) if i != param.split_axis)
        moved = np.empty(int(np.prod(moved_shape)), self.dtype)
        full = None if whole is None else np.ascontiguousarray(np.moveaxis(whole, param.split_axis, 0)).reshape(-1)
        self.tp.scatterv(full, moved, [moved.size] * self.tp.size, root=root)
        return np.ascontiguousarray(np.moveaxis(moved.reshape(moved_shape), 0, param.split_axis)).reshape(-1)


def use_muon(optimizer, topo, train_cfg) -> None:
    """Give a distributed optimizer Muon's update rule in place of AdamW: its slice, its
    tp group, and its ZeRO group when it shards (without ZeRO each replica orthogonalises
    for itself: its optimizer state is whole already). Under hybrid sharding the ZeRO
    group is the shard group: the slices were averaged over the replicas before the
    update, so each replica's S ranks own and orthogonalise every matrix between them,
    the same work in every replica, and no matrix crosses the slow link."""
    store = optimizer.store
    shards = optimizer.group.shard_comm if optimizer.zero_stage else Comm(None, topo.stats, "none")
    owners = MatrixOwners(store, optimizer.lo, optimizer.hi, topo.tp_comm, shards)
    optimizer.use_rule(Muon(store, optimizer.lo, optimizer.hi, train_cfg, owners.pieces, owners))
