"""How the planner prices communication (plan/predict.py uses it): which tier a
group's messages take, how many messages each call sends, and what point-to-point
traffic costs on links.

Ranks fill hosts in order (devices.Device.host_size), so a group of consecutive ranks
stays on one host when the ranks it spans divide a host's: tp spans tp ranks, cp
tp x cp, dp tp x cp x dp, pp all of them. Such a group uses the intra-host tier, any
other the inter-host one, and a collective that crosses hosts runs hierarchically, its
bytes split between the two tiers (link_parts). Sends and receives go to each
neighbour over the tier that reaches it; on a full-duplex link (Device.full_duplex) a ring's send and receive travel at once
(point_to_point_time), and a pipeline's messages cost what they add to the schedule's
timeline (pipeline_transfer_time).
"""

from numpitron.pipeline_parallel.schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, make_schedule
from numpitron.pipeline_parallel.timeline import simulate


def mesh_sizes(mesh) -> tuple[int, int, int, int, int]:
    """(tp, pp, dp, cp, S) of a mesh given as (tp, pp, dp, cp) or with HSDP's S after."""
    tp, pp, dp, cp, *shard = mesh
    return tp, pp, dp, cp, (shard[0] if shard and shard[0] else dp)


def expert_size(mesh) -> int:
    """ep of a mesh given with it after S (1 otherwise)."""
    return mesh[5] if len(mesh) > 5 else 1


def link_tier(kind: str, mesh, device) -> str:
    """"intra" when every group of this kind's communicator lies on one host, else "inter"."""
    tp, pp, dp, cp, S = mesh_sizes(mesh)
    span = {"tp": tp, "cp": tp * cp, "dp_cp": tp * cp * dp, "dp_shard": tp * cp * S,
            "dp_replica": tp * cp * dp, "ep": tp * expert_size(mesh), "expert_dp": tp * cp * dp,
            "expert_dp_shard": tp * cp * S}.get(kind.split(".")[0], tp * cp * dp * pp)
    host = device.host_size()
    return "intra" if span <= host and host % span == 0 or span == 1 else "inter"


def groups_across_hosts(mesh, device) -> list[str]:
    """The groups whose collectives cross hosts (those of more than one rank)."""
    tp, pp, dp, cp, S = mesh_sizes(mesh)
    sizes = {"tp": tp, "cp": cp, "dp_cp": dp * cp, "dp_shard": S * cp if S < dp else 1,
             "dp_replica": dp // S, "pp": pp}          # dp_shard is dp_cp unless hybrid
    return [group for group, size in sizes.items() if size > 1 and link_tier(group, mesh, device) == "inter"]


def group_size(kind: str, mesh) -> int:
    """Ranks of the communicator a collective kind runs on."""
    tp, pp, dp, cp, S = mesh_sizes(mesh)
    ep = expert_size(mesh)
    return {"tp": tp, "cp": cp, "dp_cp": dp * cp, "dp_shard": S * cp, "dp_replica": dp // S, "pp": pp,
            "embedding": 2, "model": tp * pp, "dp_shard_model": tp * cp * pp * S, "ep": ep,
            "expert_dp": dp * cp // ep, "expert_dp_shard": max(S * cp // ep, 1), "expert_model": tp * pp * ep}.get(kind.split(".")[0], tp * pp * dp * cp)


def messages(kind: str, ranks: int) -> int:
    """Messages one call sends one after another, each paying the latency alpha: a ring
    all-reduce 2(n - 1) (reduce-scatter, then all-gather), a reduce-scatter or an
    all-gather n - 1, an all-to-all n - 1, a broadcast a binomial tree's ceil(log2 n),
    a send or a receive 1 (docs/02-collectives-and-the-mesh.md)."""
    if ranks <= 1:
        return 0
    op = kind.split(".")[-1]
    if op in ("send", "recv"):
        return 1
    if op == "broadcast":
        return (ranks - 1).bit_length()
    return 2 * (ranks - 1) if op.startswith("all_reduce") else ranks - 1


def link_parts(kind: str, nbytes: float, calls: int, mesh, device) -> dict:
    """{tier: (bytes a rank sends on it, seconds)} of a collective kind in one step:
    calls x messages x alpha + bytes / beta on each tier it uses. `nbytes` is the flat
    ring's count (plan/traffic.py, what CommStats counts). A collective that crosses
    hosts runs hierarchically (as MPICH's does): its q ranks on each host reduce-scatter
    (or gather) among themselves, and each sends only its 1/q share across the h hosts,
    so the inter-host tier carries (h-1)/h of the buffer over q per rank, where the flat
    ring would have sent (g-1)/g of it, and the intra-host tier (q-1)/q of it; a call
    pays the messages of the collective over q ranks at the intra-host alpha and over h
    at the inter-host one."""
    group, size = kind.split(".")[0], group_size(kind, mesh)
    if link_tier(kind, mesh, device) == "intra":
        return {"intra": (nbytes, calls * messages(kind, size) * device.intra_latency + nbytes / device.intra_bandwidth)}
    tp, pp, dp, cp, S = mesh_sizes(mesh)
    stride = {"tp": 1, "cp": tp, "dp_cp": tp, "dp_shard": tp, "dp_replica": tp * cp * S, "ep": tp,
              "expert_dp": tp * expert_size(mesh), "expert_dp_shard": tp * expert_size(mesh)}.get(group)
    per_host = max(1, min(size, device.host_size() // stride)) if stride else 1     # the group's ranks on one host
    hosts = size // per_host
    if kind.endswith(("send", "recv", "broadcast", "all_to_all")) or per_host == 1:    # and pp, model, world
        return {"inter": (nbytes, calls * messages(kind, size) * device.inter_latency + nbytes / device.inter_bandwidth)}
    buffer = nbytes * size / (size - 1)        # bytes of the ring's formula -> the buffer times its factor
    intra = buffer * (per_host - 1) / per_host
    inter = buffer * (hosts - 1) / hosts / per_host
    return {"intra": (intra, calls * messages(kind, per_host) * device.intra_latency + intra / device.intra_bandwidth),
            "inter": (inter, calls * messages(kind, hosts) * device.inter_latency + inter / device.inter_bandwidth)}


def neighbours(group: str, rank, mesh) -> dict:
    """{global rank of a neighbour: (share of what this rank sends it, share of what it
    receives from it)} for the point-to-point traffic of `group`, the rank being the
    first of its stage (pp) or the ring's last (cp, Rank.cp_rank). A context-parallel
    ring sends to the next rank and receives from the previous one. A pipeline stage
    sends activations on and gradients back: half of each direction to either side, or
    all of it to its one neighbour at an end of a line (the interleaved loop wraps
    around, so there every stage has two; a V turns back on the last rank)."""
    tp, pp, dp, cp, _ = mesh_sizes(mesh)
    out = {}

    def add(peer, sends, receives):            # cp = 2 or pp = 2 in a loop: one peer on both sides
        before = out.get(peer, (0.0, 0.0))
        out[peer] = (before[0] + sends, before[1] + receives)
    if group == "cp":
        add(tp * ((rank.cp_rank + 1) % cp), 1.0, 0.0)
        add(tp * ((rank.cp_rank - 1) % cp), 0.0, 1.0)
        return out
    loops = rank.placement is not None and rank.placement.v > 1 and not rank.placement.v_shape
    sides = [side % pp for side in (rank.stage + 1, rank.stage - 1) if loops or 0 <= side < pp]
    for side in sides:
        add(side * tp * cp * dp, 1 / len(sides), 1 / len(sides))
    return out


def latency_and_bandwidth(rank: int, peer: int, device) -> tuple[float, float]:
    """(alpha, beta) of the tier between two global ranks: intra-host when hosts filled
    in order put them on one, else inter-host."""
    host = device.host_size()
    if rank // host == peer // host:
        return device.intra_latency, device.intra_bandwidth
    return device.inter_latency, device.inter_bandwidth


def point_to_point_time(group: str, comm: dict, calls: dict, rank, mesh, device) -> float:
    """A rank's sends and receives of one group (cp's ring, pp's stages) in one step:
    each neighbour's share of the bytes on the tier that reaches it (both on one host
    or not) plus alpha per message. A ring step posts its send and its receive
    together, so on a full-duplex link (Device.full_duplex) what goes out and what comes
    in travel at once; a pipeline stage's do not (it receives, computes, then sends,
    and a gradient comes back only after the stages beyond have run), so they add up,
    as they do through one node's shared memory."""
    sent, received = comm.get(f"{group}.send", 0.0), comm.get(f"{group}.recv", 0.0)
    messages_out, messages_in = calls.get(f"{group}.send", 0), calls.get(f"{group}.recv", 0)
    tp, _, dp, cp, _ = mesh_sizes(mesh)
    me = rank.cp_rank * tp if group == "cp" else rank.stage * tp * cp * dp
    out = into = 0.0
    for peer, (share_out, share_in) in neighbours(group, rank, mesh).items():
        alpha, beta = latency_and_bandwidth(me, peer, device)
        out += share_out * (messages_out * alpha + sent / beta)
        into += share_in * (messages_in * alpha + received / beta)
    return max(out, into) if group == "cp" and device.full_duplex() else out + into


def pipeline_transfer_time(parallel, pp: int, m: int, placement, stage_compute: list, message: float, mesh,
                           device) -> float:
    """Seconds a pipeline's messages add to its step on links: the schedule's timeline
    (pipeline_parallel/timeline.py) with each stage's micro-batch at its priced time (a forward
    a third, a backward two thirds, as UNIT_COST has it) and each message of `message`
    bytes crossing the link between its two stages (alpha + bytes / beta of that tier,
    one message at a time on each link), less the same timeline with free messages.
    A message hides behind the compute of stages that do not wait for it, and a slow
    link that cannot keep up stalls every micro-batch behind it; adding up the sends,
    as one node's shared memory does, counts neither."""
    tp, _, dp, cp, _ = mesh_sizes(mesh)
    stride = tp * cp * dp                   # pp rank s holds global ranks from s * stride

    def transfer(source: int, destination: int) -> float:
        alpha, beta = latency_and_bandwidth(source * stride, destination * stride, device)
        return alpha + message / beta
    schedules = [make_schedule(parallel.schedule, m, pp, stage, placement.v) for stage in range(pp)]
    costs = [{FORWARD: t / 3, BACKWARD: 2 * t / 3, INPUT_GRAD: t / 3, WEIGHT_GRAD: t / 3} for t in stage_compute]
    args = (schedules, m, placement.v, costs, placement.v_shape)
    return float(max(simulate(*args, transfer=transfer)) - max(simulate(*args)))
