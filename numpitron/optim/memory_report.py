"""The bytes one optimizer's rank keeps, measured from its live buffers (docs/09-zero-2-and-3.md): the
planner's accounting (plan/accounting.py) must reproduce them to the byte."""


def memory_bytes(optimizer) -> dict:
    """Bytes this rank keeps for the whole run (parameters, gradients, optimizer
    state), and the peaks of what exists only during a pass: parameters gathered whole
    (ZeRO-3) and whole gradient buffers (ZeRO-2 and 3). Their sum is the peak."""
    itemsize = optimizer.store.dtype.itemsize
    if optimizer.precision.mixed:
        # Low-format values are emulated in float32 arrays: count them at the format's size.
        itemsize = optimizer.precision.itemsize
    gathered_params, whole_grads = optimizer.pass_peaks()
    return {"params": optimizer.params.size * itemsize,
            "grads": sum(grads.size for grads in optimizer.kept_grads()) * itemsize,
            "optimizer_state": optimizer.adam.state_nbytes,
            "gathered_params_peak": gathered_params * itemsize,
            "backward_grads_peak": whole_grads * itemsize}
