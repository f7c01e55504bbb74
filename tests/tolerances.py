"""Every tolerance of the test suite, in one place."""

EQUIV_RTOL_FLOAT64 = 1e-10    # a parallel layout against one process, float64
EQUIV_RTOL_FLOAT32 = 1e-5     # the same in float32
KERNEL_RTOL_FLOAT32 = 1e-5    # a float32 kernel against its float64 reference (numpitron/reference.py):
#                               float32 rounds at 6e-8, and the kernels' cancellations (GELU's
#                               1 - sigmoid times y 2 du/dx) lose up to ~30x that: 2e-6 seen
FD_EPS = 1e-6                 # central finite-difference step (float64)
FD_RTOL = 1e-6                # finite differences against the analytic backward
FD_ATOL = 1e-9
CLIP_RTOL = 1e-6              # clip_ divides by norm + 1e-6 (as torch's clip_grad_norm_)


def rel_diff(actual, expected) -> float:
    """max |a - e| / max |e|: relative to the tensor's scale, so tiny entries of a
    tensor do not demand more digits than float64 has."""
    import numpy as np
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(float(np.max(np.abs(expected))), 1e-300) if expected.size else 1.0
    return float(np.max(np.abs(actual - expected))) / scale if expected.size else 0.0
