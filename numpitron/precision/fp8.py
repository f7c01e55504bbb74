"""FP8 matmuls, emulated (docs/07-numbers.md; Micikevicius et al. 2022, "FP8 Formats for
Deep Learning", §3-4; Transformer Engine's delayed-scaling recipe).

Every linear layer multiplies through a `matmul` object: `PLAIN` (a @ b) in every
precision but fp8, an `Fp8Matmul` with --precision fp8. The layers run the same code.

Two 8-bit formats (ml_dtypes), one per role:

    E4M3 (float8_e4m3fn)  4 exponent, 3 significand bits: to +-448, eps 2^-3    x and W
    E5M2 (float8_e5m2)    5 exponent, 2 significand bits: to +-57344, eps 2^-2  dL/dy

Forward operands need the finer steps; gradients span more binades and need the range.
Either covers only ~18 (E4M3) or ~32 (E5M2) binades, far fewer than a tensor's values
span from init to the end of training, so each tensor is multiplied by a scale s before
the cast, and the product divided by both operands' scales after it:

    q(a)   = fp8(clip(a s_a, -fmax, fmax))         round to nearest even, saturating
    a @ b  ~ (q(a) @ q(b)) / (s_a s_b)               products exact in fp32, summed there

One scale per tensor (not per row or block): it is a single multiply on either side of
the GEMM, which is what FP8 tensor cores take (paper, §4.3). The scale comes from the
largest |value| (amax) the same tensor had over the last AMAX_HISTORY steps, not from
this one ("delayed scaling": the cast needs no extra pass over the tensor to find its
own amax first, and no collective inside the layer to agree on it):

    s = fmax / max(amax_history) / 2^MARGIN,   rounded down to a power of two

The power of two makes the scaling exact (only the cast rounds), keeps a scale the same
when two layouts' amaxes differ in their last bit, and makes q(2^k a) = q(a) when a's
scale moves by 2^-k: a gradient that a layout's loss weight (1/micro-batches) doubles
is cast to the same fp8 values. Until a tensor has a history (the first step), its
products take bf16 operands while its amax is recorded: Transformer Engine's
"calibration", where a scale of 1 would flush the first step's small gradients.

Agreement: one process sees every piece of a tensor and every token of the batch; a
layout sees a slice (a tp shard of W, a dp share of x). At the end of each step the new
amaxes, one per (layer, role), are max-reduced over the world, so every rank holds the
same scales for every layer, the ones one process would have.
"""

import ml_dtypes
import numpy as np

from numpitron.nn.layer import Layer
from numpitron.nn.matmul import PlainMatmul
from numpitron.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
ROLES = ("x", "w", "dy")                 # forward input, weight, gradient of the output
ROLE_FORMATS = (E4M3, E4M3, E5M2)
FMAX = np.array([float(ml_dtypes.finfo(f).max) for f in ROLE_FORMATS], np.float32)
# Transformer Engine's default is 1024 steps, Megatron's 1. A tensor whose amax falls
# (gradients, as the loss falls) keeps the old, larger scale's divisor until it leaves
# the window, losing range at the bottom; one that jumps past its history saturates
# for a step. 16 rides over a single step's spike and follows a falling amax within 16
# steps of a run that lasts hundreds.
AMAX_HISTORY = 16
MARGIN = 0                               # binades kept free above the history's amax


def quantize(a: np.ndarray, scale: float, fmt: np.dtype) -> np.ndarray:
    """q(a): a s cast to fp8 with saturation, held in float32 (the values, still scaled)."""
    fmax = float(ml_dtypes.finfo(fmt).max)
    scaled = np.multiply(a, scale, dtype=np.float32)
    np.clip(scaled, -fmax, fmax, out=scaled)       # E4M3 has no inf: its cast makes nan
    return scaled.astype(fmt).astype(np.float32)


def scales_from(amax: np.ndarray) -> np.ndarray:
    """s = fmax / amax / 2^MARGIN rounded down to a power of two, per (layer, role); 0
    (none yet: calibrate) where nothing but zeros was seen."""
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(FMAX / amax)) - MARGIN
    return np.where(amax > 0, np.exp2(exponent), 0.0).astype(np.float32)


def linear_layers(model) -> dict:
    """This rank's linear layers by name, the ones whose products --precision fp8 takes
    in fp8, as Transformer Engine's recipe does; the head, attention's scores and the
    routed experts keep bf16."""
    found, todo = {}, list(model.blocks)
    while todo:
        layer = todo.pop()
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            found[layer.weight.name.removesuffix(".weight")] = layer
        else:
            todo += [v for v in vars(layer).values() if isinstance(v, Layer)]
    return found


class Fp8Matmul(PlainMatmul):
    """One linear layer's products with fp8 operands: E4M3 for x and W, E5M2 for dL/dy."""

    def __init__(self, scaling: "DelayedScaling", layer: int):
        self.scaling, self.layer = scaling, layer

    def forward(self, x, w):
        return self._product(x, 0, w, 1)

    def input_grad(self, dy, w):
        return self._product(dy, 2, w.T, 1)

    def weight_grad(self, x, dy):
        return self._product(x.T, 0, dy, 2)

    def _product(self, a, role_a, b, role_b):
        qa, sa = self.scaling.quantize(a, self.layer, role_a)
        qb, sb = self.scaling.quantize(b, self.layer, role_b)
        out = qa @ qb                                   # sgemm of exact fp8 values
        out *= 1.0 / (sa * sb)                          # a power of two: exact
        return out


class DelayedScaling:
    """The amax histories and scales of every linear layer of the model (all stages:
    names agreed over the world once), for the three roles."""

    def __init__(self, names: list[str], world, history: int = AMAX_HISTORY):
        every = world.broadcast_object(sorted({n for part in world.gather_object(names) or [] for n in part}))
        self.names, self.world = every, world
        self.history = np.zeros((len(every), len(ROLES), history), np.float32)
        self.scale = np.zeros((len(every), len(ROLES)), np.float32)
        self.amax = np.zeros_like(self.scale)          # this step's, so far

    def install(self, linears: dict) -> None:
        """Give each linear layer ({name: layer}) its fp8 matmul."""
        for name, layer in linears.items():
            layer.matmul = Fp8Matmul(self, self.names.index(name))

    def quantize(self, a, layer: int, role: int):
        """(q(a), s) with this step's scale, recording a's amax for the next steps';
        (a, 1) while the tensor has no history."""
        if a.size:
            self.amax[layer, role] = max(self.amax[layer, role], a.max(), -a.min())
        scale = float(self.scale[layer, role])
        return (quantize(a, scale, ROLE_FORMATS[role]), scale) if scale else (a, 1.0)

    def begin_step(self) -> None:
        self.amax[...] = 0                              # what evaluation saw does not count

    def end_step(self) -> None:
        """Push the step's amaxes, agreed over every rank, into the histories; new scales."""
        self.world.all_reduce(self.amax, op="max")     # every shard of W, every rank's tokens
        self.history = np.roll(self.history, 1, axis=-1)
        self.history[..., 0] = self.amax
        self.scale = scales_from(self.history.max(axis=-1))

    def state(self) -> dict:
        """The histories by layer name (the same on every rank): {name: [[x...], [w...], [dy...]]}."""
        return {name: self.history[i].tolist() for i, name in enumerate(self.names)}

    def load_state(self, saved: dict) -> None:
        """Histories saved on any mesh: matched by name; a layer saved without one starts fresh."""
        for i, name in enumerate(self.names):
            if name in saved:
                past = np.asarray(saved[name], np.float32)[:, :self.history.shape[-1]]
                self.history[i] = 0
                self.history[i, :, :past.shape[1]] = past
        self.scale = scales_from(self.history.max(axis=-1))
