"""--grad-compression's settings checked against the rest of the run, identically on
every rank before any communication (layout.py calls `check_compression`)."""

from numpitron.errors import UserError

COMPRESSIONS = ("none", "int8", "powersgd")


def check_compression(model, train, parallel) -> None:
    method = parallel.grad_compression
    if method not in COMPRESSIONS:
        raise UserError(f"unknown --grad-compression {method!r}; choose one of {', '.join(COMPRESSIONS)}")
    if isinstance(parallel.powersgd_rank, bool) or not isinstance(parallel.powersgd_rank, int) \
            or parallel.powersgd_rank < 1:
        raise UserError(f"--powersgd-rank must be a positive integer, got {parallel.powersgd_rank!r}")
    if method == "none":
        return
    refused = [(parallel.zero_stage > 1, f"--zero-stage {parallel.zero_stage}"),
               (parallel.hierarchical_all_reduce, "--hierarchical-all-reduce"),
               (model.num_experts, "--num-experts"),
               (train is not None and train.precision != "fp32", f"--precision {train and train.precision}"),
               (train is not None and train.diloco_replicas, "--diloco-replicas")]
    for on, flag in refused:
        if on:
            raise UserError(f"--grad-compression {method} is built for data parallelism in fp32 (ZeRO stage "
                            f"0 or 1, dense, no DiLoCo): not with {flag}")
