"""A predicted step time from a simple, stated model, and the plan of one layout.

* Matmuls: the rank's share of the hardware FLOPs (flops.py) at the device's peak.
* Element-wise work (LayerNorm, GELU, softmax, residuals, the loss): ELEMENTWISE_PASSES
  reads or writes of every activation byte a micro-batch keeps, at the bandwidth
  element-wise kernels reach; and AdamW, ADAM_PASSES passes over parameters, gradients
  and both moments.
* Collectives: for each kind, its bytes at the link's bandwidth plus a latency per
  call (tp and cp inside a node when their groups fit in one, the rest across
  nodes). Tensor- and context-parallel traffic is exposed; the data-parallel
  reduction is hidden behind the backward but for its last bucket.
* Pipelines: m micro-batches' stage time stretched by the schedule's bubble b, m t / (1 - b):
  (m + p - 1) t for GPipe and 1F1B; b from the unit-cost timeline of the schedule
  (parallel/schedules.py: interleaved and zero-bubble shrink it).
Each choice is an estimate, stated so that its error can be read off.
"""

from numpitron.parallel.schedules import ideal_bubble
from numpitron.plan.accounting import (Rank, activation_bytes_per_microbatch, comm_bytes,
                                       peak_activation_bytes, state_bytes)
from numpitron.plan.flops import hardware_flops, model_flops

ELEMENTWISE_PASSES = 8
ADAM_PASSES = 4


def plan(model, parallel, train, mesh, device) -> dict:
    """Memory, bytes, FLOPs and time of one iteration, per stage (the first rank of each)."""
    tp, pp, dp, cp = mesh
    m = train.num_microbatches(dp)
    global_batch = train.global_batch(dp)
    devices = tp * pp * dp * cp
    args = (global_batch, model.seq_len, model.n_layers, model.d_model, model.vocab_size)
    work = hardware_flops(*args, parallel.recompute) / devices
    # A mixed-precision device keeps activations and moves them in 16 bits: scale this
    # library's float32 accounting to it.
    scale = 0.5 if device.bytes_per_parameter else 1.0
    bubble = ideal_bubble(parallel.schedule, pp, m, parallel.virtual_stages)
    stages = []
    for stage in range(pp):
        rank = Rank(tp, pp, dp, cp, stage, cp_rank=cp - 1)      # the ring's busiest rank
        state = state_bytes(model, parallel, rank)
        if device.bytes_per_parameter:                            # mixed precision on paper
            params = state["params"] // (8 if model.dtype == "float64" else 4)
            in_pass = {k: state[k] // (4 if model.dtype == "float32" else 8) * 2
                       for k in ("gathered_params_peak", "backward_grads_peak")}
            state = {"params": 2 * params, "grads": 2 * params, **in_pass,
                     "optimizer_state": (device.bytes_per_parameter - 4) * params // (dp * cp if parallel.zero_stage else 1)}
        activations = scale * peak_activation_bytes(model, parallel, train, rank)
        comm = {kind: scale * nbytes for kind, nbytes in comm_bytes(model, parallel, train, rank).items()}
        per_mb = work / m
        t_matmul = per_mb / device.peak_flops
        t_elementwise = ELEMENTWISE_PASSES * scale * activation_bytes_per_microbatch(model, parallel, train, rank) \
            / device.memory_bandwidth
        t_comm = {kind: _link_time(kind, nbytes, mesh, device) for kind, nbytes in comm.items()}
        exposed_per_mb = sum(t for kind, t in t_comm.items() if kind.split(".")[0] in ("tp", "cp", "pp")) / m
        t_adam = ADAM_PASSES * (state["params"] + state["grads"] + state["optimizer_state"]) / device.memory_bandwidth
        dp_time = sum(t for kind, t in t_comm.items() if kind.startswith("dp_cp."))
        buckets = max(1, -(-state["grads"] // (parallel.bucket_size * 4)))
        exposed_dp = dp_time if parallel.zero_stage in (1, 3) or not parallel.overlap_grad_reduce else dp_time / buckets
        step = m * (t_matmul + t_elementwise + exposed_per_mb) / (1 - bubble) + t_adam + exposed_dp
        stages.append({"stage": stage, **state, "activations_peak": activations,
                       "total_peak": sum(state.values()) + activations, "comm_bytes": comm,
                       "time_s": {"matmul": m * t_matmul, "elementwise": m * t_elementwise,
                                  "exposed_comm": m * exposed_per_mb + exposed_dp, "optimizer": t_adam,
                                  "step": step}})
    step = max(s["time_s"]["step"] for s in stages)
    flops = model_flops(*args)
    return {"mesh": {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "devices": devices}, "microbatches": m,
            "model_flops_per_iteration": flops, "hardware_flops_per_iteration": hardware_flops(*args, parallel.recompute),
            "bubble": bubble, "step_s": step, "tokens_per_s": global_batch * model.seq_len / step,
            "mfu": flops / (step * device.peak_flops * devices), "stages": stages,
            "fits": all(s["total_peak"] <= device.memory_bytes for s in stages)}


def _link_time(kind: str, nbytes: float, mesh, device) -> float:
    tp, pp, dp, cp = mesh
    group = kind.split(".")[0]
    span = {"tp": tp, "cp": tp * cp, "dp_cp": tp * cp * dp, "pp": tp * cp * dp * pp,
            "embedding": tp * cp * dp * pp, "model": tp * cp * dp * pp, "world": tp * cp * dp * pp}[group]
    inside = span <= device.devices_per_node
    latency = device.intra_latency if inside else device.inter_latency
    bandwidth = device.intra_bandwidth if inside else device.inter_bandwidth
    return latency + nbytes / bandwidth
