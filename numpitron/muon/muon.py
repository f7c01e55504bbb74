"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"):
each hidden matrix steps along the orthogonalised momentum, the rest along AdamW.

For a hidden weight W (A x B) with gradient G, per step:

    M <- beta M + (1 - beta) G                      momentum
    U  = (1 - beta) G + beta M                      Nesterov's look-ahead
    O  = NewtonSchulz(U)                            U's singular values pushed towards 1
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O   decoupled weight decay; the scale of
                                                    Liu et al. (§2.2), which gives the update the
                                                    RMS of a typical AdamW step (about 0.2), so one
                                                    learning rate serves both optimizers

Embeddings, biases and LayerNorm gains keep AdamW (so does the head: it is the token
embedding, tied). Muon's state is one moment per element, AdamW's two.

Newton-Schulz needs the whole matrix: its products mix every element with every other,
so the element-wise slicing that lets ZeRO run AdamW on any 1/dp of a flat buffer does
not work here. `Muon` therefore receives an `orthogonalise` function that takes this
rank's pieces of every hidden matrix and returns their pieces of the update; on one
process it is `newton_schulz` matrix by matrix, on a mesh `muon/owners.py`
gathers each matrix on one owner rank (docs/10-muon.md).
"""

import math

import numpy as np

from numpitron.errors import UserError
from numpitron.optim.adamw import AdamW
from numpitron.nn.mask_runs import mask_runs

# The quintic iteration X <- a X + (b A + c A^2) X with A = X X^T (Jordan et al. 2024):
# coefficients chosen so that the slope at zero is large (a = 3.4445) and small
# singular values grow fast; five steps leave every singular value in about [0.7, 1.2],
# which serves as well as exactly 1 and costs a third of a cubic iteration's steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(G: np.ndarray, steps: int = NS_STEPS) -> np.ndarray:
    """An approximately orthogonal matrix with G's singular vectors (U V^T of G's SVD, its
    singular values mapped to about 1), in G's dtype (float32 or float64)."""
    a, b, c = NS_COEFFICIENTS
    X = G / (np.linalg.norm(G) + NS_EPS)            # Frobenius norm 1: every singular value <= 1
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T                                     # A = X X^T is then the smaller Gram matrix
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


def update_scale(shape: tuple) -> float:
    """Liu et al. (2025), eq. 4: 0.2 sqrt(max(A, B)) matches AdamW's update RMS."""
    return 0.2 * math.sqrt(max(shape))


def matrix_shape(param) -> tuple[int, int]:
    """The matrix a weight is as its layer multiplies it: (in, out); attention's fused
    (in, 3, out) q|k|v weight is one (in, 3 out) matrix."""
    shape = param.logical_shape
    if len(shape) < 2:
        raise UserError(f"--optimizer muon orthogonalises matrices, but {param.name} has shape {shape}: "
                        f"give it no weight decay (AdamW then updates it) or use --optimizer adamw")
    return shape[0], math.prod(shape[1:])


def is_hidden_matrix(param) -> bool:
    """Muon's parameters: the weights inside the blocks (weight decay marks the weights;
    biases and gains have none). The embeddings and the tied head are outside the blocks."""
    return param.name.startswith("blocks.") and param.decay


def orthogonalised(momentum: np.ndarray, shape: tuple) -> np.ndarray:
    """The step direction of one whole matrix, scaled (what an owner computes)."""
    return update_scale(shape) * newton_schulz(momentum.reshape(shape))


class MatrixPiece:
    """One hidden matrix as this rank sees it: the matrix's range [a, b) of the store's
    flat layout (its tp-local shard) and the part [start, stop) of it inside this rank's
    slice [lo, hi), at `offset` of the packed vector of matrix elements (empty when the
    slice misses the matrix)."""

    def __init__(self, param, a: int, b: int, lo: int, hi: int, offset: int):
        self.param, self.a, self.b = param, a, b
        self.shape = matrix_shape(param)
        self.start, self.stop = min(max(a, lo), hi), max(min(b, hi), lo)
        self.stop = max(self.stop, self.start)
        self.offset = offset

    @property
    def count(self) -> int:
        return self.stop - self.start


def matrix_pieces(store, lo: int, hi: int) -> list[MatrixPiece]:
    """Every hidden matrix of the store in layout order, with its piece of [lo, hi)."""
    pieces, offset = [], 0
    for p in store.params:
        if is_hidden_matrix(p):
            a, b = store.offsets[p.name]
            pieces.append(MatrixPiece(p, a, b, lo, hi, offset))
            offset += pieces[-1].count
    return pieces


def local_orthogonalise(pieces):
    """One process (or a rank that holds every matrix whole): Newton-Schulz in place."""
    def orthogonalise(u: np.ndarray) -> np.ndarray:
        out = np.empty_like(u)
        for piece in pieces:
            span = slice(piece.offset, piece.offset + piece.count)
            out[span] = orthogonalised(u[span], piece.shape).reshape(-1)
        return out
    return orthogonalise


class Muon:
    """The update rule over a rank's slice [lo, hi) of a store's flat buffers (the whole
    stage without ZeRO): Muon on the hidden matrices' elements, AdamW on the others.
    Each set is packed into its own vector, so AdamW keeps two moments only for the
    elements it updates and Muon one. The same interface as `AdamW` (update,
    step_count, state_nbytes, flat_state, load_state)."""

    BUFFERS = ("adam_m", "adam_v", "muon_m")

    def __init__(self, store, lo: int, hi: int, train_cfg, pieces, orthogonalise):
        self.pieces, self.orthogonalise = pieces, orthogonalise
        self.size = hi - lo
        in_matrix = np.zeros(self.size, bool)
        for piece in pieces:
            in_matrix[piece.start - lo:piece.stop - lo] = True
        self.matrix_runs = mask_runs(in_matrix)           # in slice coordinates
        self.adam_runs = mask_runs(~in_matrix)
        decay = np.zeros(self.size, bool)
        for p in store.params:
            a, b = store.offsets[p.name]
            decay[max(a, lo) - lo:max(min(b, hi), lo) - lo] = p.decay
        self.adam_decay_runs = mask_runs(self.pack(decay, self.adam_runs))
        n_adam, n_matrix = int((~in_matrix).sum()), int(in_matrix.sum())
        self.adam = AdamW(n_adam, store.dtype, train_cfg.beta1, train_cfg.beta2, train_cfg.eps,
                          train_cfg.weight_decay)
        self.momentum = np.zeros(n_matrix, store.dtype)
        self.beta, self.weight_decay = train_cfg.muon_momentum, train_cfg.weight_decay
        self.lr_ratio = (train_cfg.muon_lr or train_cfg.lr) / train_cfg.lr
        self._params, self._grads = np.empty(n_adam, store.dtype), np.empty(n_adam, store.dtype)

    @staticmethod
    def pack(flat: np.ndarray, runs, out: np.ndarray | None = None) -> np.ndarray:
        """The elements of `flat` on `runs`, back to back."""
        out = np.empty(sum(b - a for a, b in runs), flat.dtype) if out is None else out
        k = 0
        for a, b in runs:
            out[k:k + b - a] = flat[a:b]
            k += b - a
        return out

    @staticmethod
    def unpack(packed: np.ndarray, runs, flat: np.ndarray) -> np.ndarray:
        k = 0
        for a, b in runs:
            flat[a:b] = packed[k:k + b - a]
            k += b - a
        return flat

    @property
    def step_count(self) -> int:
        return self.adam.step_count

    @property
    def state_nbytes(self) -> int:
        return self.adam.state_nbytes + self.momentum.nbytes

    def update(self, params, grads, decay_runs, lr: float) -> None:
        """One step on `params` (this rank's slice) in place. Collective: every rank that
        holds a piece of a hidden matrix calls it (through `orthogonalise`).
        decay_runs is AdamW's interface; Muon knows its own from the store."""
        # AdamW on the embeddings, biases and gains, packed.
        p = self.pack(params, self.adam_runs, self._params)
        self.adam.update(p, self.pack(grads, self.adam_runs, self._grads), self.adam_decay_runs, lr)
        self.unpack(p, self.adam_runs, params)
        # Muon on the hidden matrices.
        beta, m = self.beta, self.momentum
        g = self.pack(grads, self.matrix_runs)
        m *= beta                                        # M = beta M + (1 - beta) G
        m += (1 - beta) * g
        g *= 1 - beta                                    # U = (1 - beta) G + beta M
        g += beta * m
        step = self.orthogonalise(g)                     # 0.2 sqrt(max(A, B)) NS(U), whole matrices
        lr_muon, k = lr * self.lr_ratio, 0
        for a, b in self.matrix_runs:
            params[a:b] *= 1 - lr_muon * self.weight_decay    # decoupled weight decay
            params[a:b] -= lr_muon * step[k:k + b - a]
            k += b - a

    def flat_state(self) -> dict:
        """Each buffer laid out like the slice (zeros where the other rule updates): what
        a checkpoint saves, so that it loads on any mesh and ZeRO stage."""
        zeros = lambda: np.zeros(self.size, self.momentum.dtype)        # noqa: E731
        return {"adam_m": self.unpack(self.adam.m, self.adam_runs, zeros()),
                "adam_v": self.unpack(self.adam.v, self.adam_runs, zeros()),
                "muon_m": self.unpack(self.momentum, self.matrix_runs, zeros())}

    def load_state(self, adam_m, adam_v, muon_m, step_count: int) -> None:
        self.adam.load_state(self.pack(adam_m, self.adam_runs), self.pack(adam_v, self.adam_runs), step_count)
        self.pack(muon_m, self.matrix_runs, self.momentum)
