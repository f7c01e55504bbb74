"""Mixed-precision training emulated in float32 (docs/07-numbers.md; Micikevicius et al.
2018, "Mixed Precision Training", §3).

A run in bf16 or fp16 keeps three things in the low format and everything else in fp32:

  parameters    what the layers multiply by: the fp32 master weights rounded after every
                update (precision/master_weights.py keeps the master copy, fp32 Adam moments);
  activations   what each layer produces (nn/layer.py, Layer.precision) and keeps for its
                backward, in 2-byte arrays; the gradient handed between layers (model.py);
  gradients     what the optimizer receives, after the reduction over dp.

The layers themselves compute in float32: a BLAS on a CPU has no bf16 GEMM. A product of
two low-format numbers is exact in fp32 (8 + 8 significand bits fit in 24; 11 + 11 for
fp16 fit too), and tensor cores accumulate such products in fp32, so "cast to fp32,
sgemm, round the result" is a tensor-core matmul up to the order of the summation.
LayerNorm, softmax and the loss compute in fp32 on a GPU as well.

What is emulated exactly: the rounding (round to nearest even, `astype` of ml_dtypes and
NumPy), the formats' ranges (fp16 overflows to inf above 65504, flushes below 2^-24),
and each kernel writing its output in the low format: a layer rounds what it produces
(a GEMM's output, a LayerNorm's, GELU's, the softmax's, attention's) and keeps its
activations for the backward in 2-byte arrays (`keep`), widened where the backward reads
them (`widen`). The statistics (LayerNorm's 1/std, attention's log-sum-exps) and the
loss's probabilities stay fp32, as accelerators' kernels keep them. What is not: the
arithmetic in between runs in float32 arrays (two casts a rounding); the memory report
counts parameters and gradients at the format's size (optim/memory_report.py).
"""

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from numpitron.errors import UserError
from numpitron.nn.layer import Layer


@dataclass(frozen=True)
class Format:
    name: str
    dtype: np.dtype         # the low format's NumPy dtype
    loss_scale: float       # the default initial loss scale (1: none needed)
    fp8_matmuls: bool = False   # the linear layers' products in FP8 (precision/fp8.py)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    @property
    def eps(self) -> float:
        """The distance from 1 to the next number: a rounding errs by at most eps / 2."""
        return float(ml_dtypes.finfo(self.dtype).eps)

    def round(self, x: np.ndarray) -> np.ndarray:
        """x rounded to this format, kept in x's dtype (a new array; fp32: x itself)."""
        if not self.mixed:
            return x
        with np.errstate(over="ignore"):          # fp16 overflow to inf is the point
            return x.astype(self.dtype).astype(x.dtype)

    def keep(self, x: np.ndarray) -> np.ndarray:
        """x as a cache keeps it for the backward: a 2-byte array in a mixed run (x's
        rounding; exact when x holds the format's values, as a layer's output does),
        x itself in fp32. `widen` gives the float32 array back."""
        return x.astype(self.dtype) if self.mixed else x

    def widen(self, kept: np.ndarray) -> np.ndarray:
        """What `keep` kept, as the float32 array the layers compute with."""
        return kept.astype(np.float32) if self.mixed else kept

    def round_(self, x: np.ndarray) -> None:
        """Round x in place."""
        if self.mixed:
            with np.errstate(over="ignore"):
                x[...] = x.astype(self.dtype)


def use_format(model, fmt: Format) -> None:
    """A run's number format, installed in the stage (which rounds what one layer hands
    the next) and in every layer inside it (which rounds what it produces and keeps its
    activations in the format: nn/layer.py)."""
    model.precision = fmt
    for layer in sublayers(model.layers):
        layer.precision = fmt


def sublayers(layers) -> list:
    """The layers and every layer inside them (attributes and lists of them), once each."""
    found, seen, todo = [], set(), list(layers)
    while todo:
        layer = todo.pop()
        if isinstance(layer, Layer) and id(layer) not in seen:
            seen.add(id(layer))
            found.append(layer)
            for value in vars(layer).values():
                todo += value if isinstance(value, list) else [value]
    return found


# bf16 keeps fp32's 8 exponent bits (range to 3e38): gradients neither overflow nor
# underflow, so it needs no loss scale. fp16's 5 exponent bits reach 65504 and, with
# subnormals, 6e-8: small gradients flush to zero unless the loss is scaled up first.
FORMATS = {
    "fp32": Format("fp32", np.dtype(np.float32), 1.0),
    "bf16": Format("bf16", np.dtype(ml_dtypes.bfloat16), 1.0),
    "fp16": Format("fp16", np.dtype(np.float16), 2.0 ** 16),
    # FP8 (Micikevicius et al. 2022): the linear layers' operands in E4M3 and E5M2 with
    # per-tensor scales (precision/fp8.py); everything else, as in Transformer Engine, in bf16.
    "fp8": Format("fp8", np.dtype(ml_dtypes.bfloat16), 1.0, fp8_matmuls=True),
}
PRECISIONS = tuple(FORMATS)

# What gradients are summed in over the data-parallel ranks (--grad-reduce-dtype,
# docs/07-numbers.md): "param", the low format itself (2 bytes an element on the wire,
# every partial sum rounded to it), or "fp32" (4 bytes; the sum of the low-format
# gradients is rounded once, when it lands in the low-format gradient buffer).
GRAD_REDUCE_DTYPES = ("fp32", "param")


def wires(fmt: Format, grad_reduce_dtype: str) -> tuple:
    """(gradients' wire format, parameters' wire format) for Comm's collectives: None
    where the float32 arrays travel as they are. Parameters are gathered in the low
    format (exactly: they hold its values); an fp32 run sends everything as it is."""
    if not fmt.mixed:
        return None, None
    return (fmt.dtype if grad_reduce_dtype == "param" else None), fmt.dtype


def check_precision(precision: str, dtype: str, loss_scale: float, loss_scale_window: int) -> None:
    """One clear line for a precision the run cannot use."""
    if precision not in FORMATS:
        raise UserError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if FORMATS[precision].mixed and dtype != "float32":
        raise UserError(f"precision {precision} keeps float32 master weights: use --dtype float32, not {dtype}")
    if loss_scale != 0:
        exponent = np.log2(loss_scale) if loss_scale > 0 else 0.5
        if not np.isfinite(exponent) or exponent != int(exponent):
            raise UserError(f"--loss-scale must be a positive power of two (or 0: the format's default), "
                            f"got {loss_scale}")
    if isinstance(loss_scale_window, bool) or not isinstance(loss_scale_window, int) or loss_scale_window < 1:
        raise UserError(f"--loss-scale-window must be a positive integer, got {loss_scale_window}")


class LossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, §3.2; Megatron's and PyTorch's
    GradScaler): the loss, and so every gradient, is multiplied by `scale` before the
    backward, so small gradients stay above fp16's smallest number; the optimizer
    divides it out in fp32. A step whose gradients overflowed (inf or nan) is skipped
    and the scale halved; after `window` clean steps in a row it doubles. Only fp16
    scales dynamically; bf16 and fp32 keep a scale of 1 (or the one given)."""

    def __init__(self, fmt: Format, initial: float = 0.0, window: int = 1000):
        self.precision = fmt.name
        self.dynamic = fmt.name == "fp16"
        self.scale = float(initial or fmt.loss_scale)
        self.window, self.clean_steps, self.skipped_steps = window, 0, 0

    def record(self, finite: bool) -> bool:
        """After a step's gradients are known: True if the step may be applied."""
        if not self.dynamic:
            return finite
        if not finite:
            self.scale = max(self.scale / 2, 1.0)
            self.clean_steps = 0
            self.skipped_steps += 1
            return False
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.scale *= 2
            self.clean_steps = 0
        return True

    def state(self) -> dict:
        return {"loss_scale": self.scale, "skipped_steps": self.skipped_steps}

    def checkpoint(self) -> dict:
        """What a resumed run needs to scale, skip and double exactly as this one would:
        the scale, the clean steps since it last changed, the steps skipped so far."""
        return {"precision": self.precision, "loss_scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps}

    def restore(self, saved: dict | None) -> None:
        """Continue from a checkpoint's scaler (`saved_loss_scaler` checked it) if it was
        saved in this precision. Another precision's scale means nothing here (a bf16
        run's 1 would underflow fp16's gradients): this run's own initial scale stays."""
        if saved is not None and saved["precision"] == self.precision:
            self.scale, self.clean_steps = float(saved["loss_scale"]), saved["clean_steps"]
            self.skipped_steps = saved["skipped_steps"]


def saved_loss_scaler(saved, where: str) -> dict | None:
    """A checkpoint manifest's `loss_scaler` entry, checked (None: saved before scalers
    were, or by no trainer); one line for anything a scaler could not continue from."""
    if saved is None:
        return None
    counts = ("clean_steps", "skipped_steps")
    ok = (isinstance(saved, dict) and saved.get("precision") in FORMATS
          and isinstance(saved.get("loss_scale"), (int, float)) and not isinstance(saved.get("loss_scale"), bool)
          and all(isinstance(saved.get(k), int) and not isinstance(saved.get(k), bool) and saved[k] >= 0
                  for k in counts))
    if ok:
        exponent = np.log2(saved["loss_scale"]) if saved["loss_scale"] > 0 else 0.5
        ok = bool(np.isfinite(exponent) and exponent == int(exponent))
    if not ok:
        raise UserError(f"corrupt checkpoint manifest in {where}: loss_scaler is {saved!r}, not a precision, "
                        f"a power-of-two loss_scale and non-negative clean_steps and skipped_steps")
    return saved
