"""A predicted step time from a simple, stated model, and the plan of one layout.

Compute is what kernels.py counts this library's NumPy code executing on a rank, one
micro-batch at a time, priced by the device profile (devices.py):

* matmuls: each one's FLOPs at the rate BLAS reaches on calls of its size (the
  profile's matmul curve; the peak on a GPU);
* element-wise passes: 3 x itemsize bytes per element (two operands in, one out) at
  the bandwidth element-wise kernels reach on activation-sized arrays;
* exponentials: exp_time per element (arithmetic-bound on a CPU, 0 on a GPU);
* calls: call_time per NumPy call (0 on a GPU, whose launches are asynchronous);
* AdamW: its passes over the elements the rank updates, and the norm, clipping and
  zeroing over its gradient buffer, priced the same way;
* Muon (muon_cost.py): the busiest owner's Newton-Schulz products, which every rank
  waits for in the scatter, and the owners' gathers and scatters, all exposed.

Collectives: for each kind, its bytes at its tier's bandwidth plus, for each call, the
tier's latency alpha once per message the call's algorithm sends in a row (`messages`:
2(n - 1) for a ring all-reduce, n - 1 for a reduce-scatter or an all-gather, 1 for a
send), over the calls the step makes (accounting.comm_calls: per block and micro-batch
for tp, per bucket for dp, per micro-batch for pp), on the tier each group's
messages take (plan/links.py: hosts filled in order, hierarchical collectives across
hosts, point-to-point traffic per neighbour). Tensor-, context- and pipeline-parallel
traffic is exposed; the data-parallel reduction is hidden behind the last
micro-batch's backward but for its last bucket and what the link cannot carry in that
backward. On links a pipeline's messages cost what they add to the schedule's
timeline (links.pipeline_transfer_time) instead of their sum.

Pipelines: m micro-batches' stage time stretched by the schedule's bubble b, m t / (1 - b):
(m + p - 1) t for GPipe and 1F1B; b from the unit-cost timeline of the schedule
(pipeline_parallel/schedules.py: interleaved and zero-bubble shrink it; paired chunks, which
wait for both inputs, grow it: plan/a2a_overlap.py). With ranks sharing
cores, a rank idle in the bubble lends its core to the others, so the stretch is
max(share, 1 / (1 - b)) over the share alone.

Time-sharing: with more ranks than a CPU node has cores, each rank gets cores / ranks
of a core, so compute and the exposed communication (a rank waiting in MPI holds its
core, or waits for a peer that is not running) take ranks / cores times as long; and
each blocking collective (sync_points) adds the profile's time_sharing_wait, the time
a peer takes to be scheduled (measured by benchmarks/calibrate.py).

The slowest rank: ranks that wait for each other go at the pace of whichever lost
most time, so a step of more than one rank is stretched by the profile's slowest_rank
(the slowest of the node's ranks over a rank's own time on the same work, calibrated;
1 on GPUs).

Each choice is an estimate, stated so that its error can be read off.
"""

from numpitron.distributed.sharding import pad_to_multiple
from numpitron.pipeline_parallel.schedules import placement_of
from numpitron.pipeline_parallel.timeline import ideal_bubble
from numpitron.plan.a2a_overlap import a2a_exposure, paired_bubble, pairs_chunks, pairs_per_iteration
from numpitron.plan.accounting import Rank, parameter_elements, state_bytes
from numpitron.plan.traffic import comm_bytes, comm_calls, gradient_buckets
from numpitron.plan.activations import peak_activation_bytes
from numpitron.plan.experts import moe_block_work, moe_flops_delta
from numpitron.plan.flops import hardware_flops, model_flops
from numpitron.precision.formats import FORMATS
from numpitron.plan.links import (expert_size, groups_across_hosts, link_parts, link_tier, mesh_sizes,
                                  pipeline_transfer_time, point_to_point_time)
from numpitron.plan.kernels import Work, block_work, embedding_work, head_work, optimizer_work
from numpitron.plan.muon_cost import muon_cost, newton_schulz_work
from numpitron.plan.slow_links import diloco_state_bytes, hidden_outer_seconds


def plan(model, parallel, train, mesh, device) -> dict:
    """Memory, bytes, FLOPs and time of one iteration, per stage (the first rank of each).
    mesh: (tp, pp, dp, cp), and HSDP's S (default dp), and ep (default 1)."""
    tp, pp, dp, cp, S = mesh_sizes(mesh)
    ep = expert_size(mesh)
    m = train.num_microbatches(dp)
    global_batch = train.global_batch(dp)
    devices = tp * pp * dp * cp
    args = (global_batch, model.seq_len, model.n_layers, model.d_model, model.vocab_size)
    # A mixed-precision device keeps activations and moves them in 16 bits: scale this
    # library's float32 accounting to it.
    # A run in --precision bf16 / fp16 is counted as it runs (plan/accounting.py), not on paper.
    on_paper = device.bytes_per_parameter and not FORMATS[train.precision].mixed
    scale = 0.5 if on_paper else 1.0
    itemsize = scale * model.itemsize
    share = device.time_sharing(devices)
    stretch = share * device.pace(devices)       # time-sharing, and the pace of the slowest rank
    bubble = (paired_bubble if pairs_chunks(model, parallel) else ideal_bubble)(parallel.schedule, pp, m,
                                                                                parallel.virtual_stages)
    stages, stage_compute, message = [], [], 0.0
    # A pipeline on links: its messages cost what they add to the schedule's timeline
    # (pipeline_transfer_time, after the loop), not their sum.
    on_timeline = ("pp",) if pp > 1 and device.full_duplex() else ()
    placement = placement_of(parallel.schedule, pp, parallel.virtual_stages)
    for stage in range(pp):
        rank = Rank(tp, pp, dp, cp, stage, cp_rank=cp - 1, dp_shard=S, placement=placement, ep=ep)  # the ring's busiest
        state = {**state_bytes(model, parallel, rank, train.optimizer, train.precision),
                 **diloco_state_bytes(model, parallel, train, rank)}         # θ_start, outer momentum: slow_links.py
        muon = muon_cost(model, parallel, rank) if train.optimizer == "muon" else {"comm_bytes": {}, "busiest_shapes": []}
        if on_paper:                                              # mixed precision on paper
            params = state["params"] // model.itemsize
            in_pass = {k: state[k] // model.itemsize * 2
                       for k in ("gathered_params_peak", "backward_grads_peak")}
            state = {"params": 2 * params, "grads": 2 * params, **in_pass,
                     "optimizer_state": (device.bytes_per_parameter - 4) * params // (rank.shard_group if parallel.zero_stage else 1)}
        activations = scale * peak_activation_bytes(model, parallel, train, rank)
        comm = {kind: scale * nbytes for kind, nbytes in comm_bytes(model, parallel, train, rank).items()}
        calls = comm_calls(model, parallel, train, rank)
        muon_comm = {kind: scale * nbytes for kind, nbytes in muon["comm_bytes"].items()}
        per_mb = price(microbatch_work(model, parallel, train, rank), device, itemsize)
        # On a cluster a rank waiting for a link gives its core away, so time-sharing
        # does not stretch link time (on one CPU node a "link" is a copy a core makes).
        on_links = share if device.ranks_per_host else 1.0
        # Each collective's bytes and seconds on the tiers it uses (a hierarchical one: both);
        # Muon's gathers and scatters priced as one call a kind (its alpha is not counted per matrix).
        parts = {kind: link_parts(kind, nbytes, calls[kind], mesh, device) for kind, nbytes in comm.items()
                 if not kind.endswith((".send", ".recv"))}
        muon_parts = {kind: link_parts(kind, nbytes, 1, mesh, device) for kind, nbytes in muon_comm.items()}
        t_comm = {kind: sum(t for _, t in p.values()) / on_links for kind, p in parts.items()}
        t_muon_comm = {kind: sum(t for _, t in p.values()) / on_links for kind, p in muon_parts.items()}
        tiers = {}

        def to_tier(tier, nbytes, seconds):
            entry = tiers.setdefault(tier, {"bytes": 0.0, "seconds": 0.0})
            entry["bytes"] += nbytes
            entry["seconds"] += seconds
        for p in (*parts.values(), *muon_parts.values()):
            for tier, (nbytes, seconds) in p.items():
                to_tier(tier, nbytes, seconds / on_links)
        for group in {kind.split(".")[0] for kind in comm if kind.endswith((".send", ".recv"))}:
            t_comm[f"{group}.send_recv"] = point_to_point_time(group, comm, calls, rank, mesh, device) / on_links
            to_tier(link_tier(f"{group}.send", mesh, device),
                    comm.get(f"{group}.send", 0.0) + comm.get(f"{group}.recv", 0.0), t_comm[f"{group}.send_recv"])
        exposed_per_mb = sum(t for kind, t in t_comm.items() if kind.split(".")[0] in ("tp", "cp", "pp", "ep")
                             and kind.split(".")[0] not in on_timeline) / m
        # The experts' all-to-alls a schedule's pairs hide (plan/a2a_overlap.py); none without --moe-a2a-overlap.
        pair_count = pairs_per_iteration(parallel, m, pp, stage) if pairs_chunks(model, parallel) else 0
        a2a = a2a_exposure(t_comm.get("ep.all_to_allv", 0.0), sum(per_mb.values()), m, placement.v, pair_count,
                           1 + (parallel.recompute == "full"))
        exposed_per_mb -= a2a["hidden"] / m
        if on_timeline:
            message = comm.get("pp.send", 0.0) / max(calls.get("pp.send", 0), 1)
            stage_compute.append(stretch * (sum(per_mb.values()) + exposed_per_mb))
        t_adam = sum(price(step_work(model, parallel, rank), device, itemsize).values())
        t_muon = sum(price(newton_schulz_work(muon["busiest_shapes"]), device, itemsize).values())
        dp_time = sum(t for kind, t in t_comm.items()
                      if kind.startswith(("dp_cp.", "dp_shard.", "dp_replica.", "expert_dp.", "expert_dp_shard.",
                                          "diloco.", "diloco_metrics.")))
        buckets = gradient_buckets(model, rank, parallel.bucket_size)
        overlapped = parallel.zero_stage in (0, 2) and parallel.overlap_grad_reduce and not parallel.hierarchical_all_reduce
        # Overlapped, the last bucket is exposed, and whatever the link could not carry
        # during the last micro-batch's backward (two thirds of its compute).
        exposed_dp = max(dp_time / buckets, dp_time - 2 / 3 * sum(per_mb.values())) if overlapped else dp_time
        exposed_dp += sum(t_muon_comm.values())
        exposed_dp -= hidden_outer_seconds(train, sum(t for kind, t in t_comm.items() if kind.startswith("diloco.")),
                                           m * sum(per_mb.values()))           # streaming DiLoCo's τ steps
        if share > 1:                      # each blocking collective waits for a peer to be scheduled
            per_mb_syncs, step_syncs = sync_points(model, parallel, rank)
            exposed_per_mb += per_mb_syncs * device.time_sharing_wait / stretch
            exposed_dp += step_syncs * device.time_sharing_wait / stretch
        busy = stretch * m * (sum(per_mb.values()) + exposed_per_mb)
        # A rank idle in the bubble gives its core to the ranks sharing it: with `share`
        # ranks a core the bubble costs only what 1 / (1 - b) exceeds the sharing by.
        idle = busy * (max(share, 1 / (1 - bubble)) / share - 1)
        step = busy + idle + stretch * (t_adam + t_muon + exposed_dp)
        for kind, nbytes in muon_comm.items():
            comm[kind] = comm.get(kind, 0.0) + nbytes
        stages.append({"stage": stage, **state, "activations_peak": activations,
                       "total_peak": sum(state.values()) + activations, "comm_bytes": comm, "tiers": tiers,
                       **({"all_to_all": {k: stretch * v if k not in ("pairs",) else v for k, v in a2a.items()}}
                          if a2a["all_to_all"] else {}),
                       **({"newton_schulz": {k: muon[k] for k in ("owner_flops", "flops_total", "imbalance")}}
                          if "owner_flops" in muon else {}),
                       "time_s": {**{kind: stretch * m * t for kind, t in per_mb.items()},
                                  "exposed_comm": stretch * (m * exposed_per_mb + exposed_dp),
                                  "optimizer": stretch * t_adam, "newton_schulz": stretch * t_muon, "bubble": idle,
                                  "step": step}})
    if stage_compute:
        added = pipeline_transfer_time(parallel, pp, m, placement, stage_compute, message, mesh, device)
        for stage in stages:
            stage["time_s"]["exposed_comm"] += added
            stage["time_s"]["step"] += added
    step = max(s["time_s"]["step"] for s in stages)
    tokens = global_batch * model.seq_len
    flops = model_flops(*args) + moe_flops_delta(model, tokens)
    executed = hardware_flops(*args, parallel.recompute) + moe_flops_delta(model, tokens, 1 + (parallel.recompute == "full"))
    return {"mesh": {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "dp_shard": S, "ep": ep, "devices": devices},
            "microbatches": m, "groups_across_hosts": groups_across_hosts(mesh, device),
            "model_flops_per_iteration": flops, "hardware_flops_per_iteration": executed,
            "bubble": bubble, "time_sharing": share, "pace": stretch / share, "step_s": step, "tokens_per_s": global_batch * model.seq_len / step,
            "mfu": flops / (step * device.peak_flops * devices), "stages": stages,
            "fits": all(s["total_peak"] <= device.memory_bytes for s in stages)}


def microbatch_work(model, parallel, train, rank: Rank) -> Work:
    """What one micro-batch costs this rank: its blocks (an MoE block's experts over its
    kept rows under balanced routing), and the embedding or the head when its stage has
    them (all its virtual chunks together)."""
    B, T, C = train.micro_batch_size, model.seq_len // rank.cp, model.d_model
    vocab = pad_to_multiple(model.vocab_size, rank.tp) // rank.tp
    blocks = rank.blocks(model.n_layers)
    work = block_work(B, T, C, model.n_heads, rank.tp, rank.cp, parallel.sequence_parallel,
                      parallel.recompute).scaled(len(blocks))
    if model.num_experts:           # an MoE block's experts and router in place of its dense MLP
        work += moe_block_work(model, B, rank.cp, rank.tp, parallel.recompute).scaled(sum(map(model.is_moe_block, blocks)))
    if rank.first:
        work += embedding_work(B, T, C, vocab)
    if rank.last:
        work += head_work(B, T, C, vocab, rank.tp, parallel.sequence_parallel)
    return work


def step_work(model, parallel, rank: Rank) -> Work:
    """The optimizer step: AdamW over this rank's elements (its 1/(dp cp) slice under
    ZeRO), the gradient norm, clipping and zeroing over its gradient buffer."""
    size, group = parameter_elements(model, rank)[0], rank.shard_group
    updated = size if parallel.zero_stage == 0 else -(-size // group)
    return optimizer_work(updated, size if parallel.zero_stage < 2 else updated)


def sync_points(model, parallel, rank: Rank) -> tuple[int, int]:
    """Blocking collectives a rank waits in: (per micro-batch, per step). Per micro-batch:
    tensor parallelism's f and g (four a block, six under full recomputation, one for
    the embedding, one for the head and three for the loss; a gather and a
    reduce-scatter each with sequence parallelism, counted as one); the context-parallel
    ring's waits (cp - 1 forward, 2 cp - 1 backward, a block); a pipeline's receives and
    sends (Rank.pipeline_messages each way). Per step: the data-parallel reduction and
    the loss, the norm, and a pipeline's loss broadcast and tied-embedding all-reduce
    (none on rank 0 of a V, which holds the one copy)."""
    L, full = model.n_layers // rank.pp, parallel.recompute == "full"
    per_mb = 0
    if rank.tp > 1:
        per_mb += L * (4 + 2 * full) + rank.first + 4 * rank.last
    if rank.cp > 1:
        per_mb += L * ((rank.cp - 1) * (1 + full) + 2 * rank.cp - 1)
    if rank.pp > 1:
        per_mb += 2 * rank.pipeline_messages()
    if rank.ep > 1:                  # the counts' all-to-all and four all_to_allv a forward and backward
        per_mb += sum(map(model.is_moe_block, rank.blocks(model.n_layers))) * (5 + 3 * full)
    per_step = (2 if rank.dp * rank.cp > 1 else 0) + (1 if rank.tp * rank.pp > 1 or parallel.zero_stage else 0) \
        + (1 + (rank.first != rank.last) if rank.pp > 1 else 0)        # the loss; the tied embedding
    return per_mb, per_step


def price(work: Work, device, itemsize: float) -> dict:
    """Seconds of each kind of work on one rank with a core (or a GPU) to itself."""
    return {"matmul": sum(flops / device.matmul_flops(size) for size, flops in work.matmul.items()),
            "elementwise": 3 * itemsize * work.passes / device.memory_bandwidth,
            "exp": work.exps * device.exp_time, "calls": work.calls * device.call_time}
