"""What a mixture-of-experts block adds to a rank's plan (docs/13-experts.md), from the
configs alone: the experts' elements, the rows the all-to-alls carry, their FLOPs.

A rank holds E/ep routed experts of each MoE block of its stage, whole (tp splits each
one's hidden layer as in the dense MLP), in a second flat buffer whose gradients are
averaged over expert_dp = dp x cp / ep ranks; the rest of an MoE block (attention, the
router, the shared experts) is in the dense buffer like any block.

Rows. A rank routes k choices for each of its B T/cp tokens per micro-batch; per
sequence an expert keeps at most capacity = ceil(c k T / E) of them (c = 0: all). The
planner assumes balanced routing, every expert drawing k T / E choices of a sequence,
so a sequence keeps min(k T, E capacity) choices; with a capacity that every expert
fills (c k T / E below its share) this is exact whatever the routing, and dropless it
is the balanced ideal a real run only approaches. Of a rank's kept rows (ep - 1)/ep
go to other ep ranks (S) and as many come back from them (R).
"""

import math
from functools import cache

from numpitron.distributed.sharding import pad_to_multiple
from numpitron.distributed.topology import Topology
from numpitron.transformer.block import Block
from numpitron.experts.moe import MixtureOfExperts
from numpitron.experts.router import capacity
from numpitron.plan.collective_bytes import all_reduce_bytes, half_bytes
from numpitron.plan.kernels import Work, mlp_work

COUNT_ITEM = 8       # the all-to-all of row counts, and the router's choices, travel as int64
LOG_ITEM = 8         # the routing log (aux loss, drops, loads) is reduced in float64


def moe_config(model) -> dict:
    """The MoE block's keyword arguments, as the model builds them (its aux-loss weight,
    log and balancing bias do not change its Params)."""
    return dict(num_experts=model.num_experts, top_k=model.moe_top_k, capacity_factor=model.moe_capacity_factor,
                aux_loss_coef=0.0, shared_experts=model.moe_shared_experts, expert_hidden=model.moe_expert_hidden)


@cache
def moe_layer_params(model, tp: int) -> dict:
    """{"moe_block": the dense-buffer Params of an MoE block on one tp rank, "expert":
    one routed expert's}: built as rank 0 of a mesh of tp x ep = E without
    communicators (it holds one expert), never allocated."""
    topo = Topology(None, tp, 1, 1, ep=model.num_experts)
    moe = MixtureOfExperts("blocks.0.mlp", model.d_model, topo, Block.out_std(model.n_layers), **moe_config(model))
    block = Block("blocks.0", model.d_model, model.n_heads, model.n_layers, topo, mlp=moe)
    experts = block.mlp.experts.parameters()
    return {"moe_block": tuple(p for p in block.parameters() if all(p is not e for e in experts)),
            "expert": tuple(experts)}


def moe_layer_sizes(model, tp: int) -> dict:
    """{piece: ((elements, tp-replicated?) of each Param)} of moe_layer_params."""
    return {piece: tuple((math.prod(p.local_shape), p.split_axis is None) for p in params)
            for piece, params in moe_layer_params(model, tp).items()}


def moe_block_elements(model) -> tuple[int, int]:
    """(every parameter, the ones one token uses) of an MoE block on one rank: attention,
    the router, the shared experts and E routed experts; a token runs top-k of them."""
    sizes = moe_layer_sizes(model, 1)
    dense, one_expert = (sum(n for n, _ in sizes[piece]) for piece in ("moe_block", "expert"))
    return dense + model.num_experts * one_expert, dense + model.moe_top_k * one_expert


def moe_blocks_of(model, blocks) -> int:
    return sum(map(model.is_moe_block, blocks))


def expert_elements(model, blocks, tp: int, ep: int) -> int:
    """The expert buffer of a rank whose stage holds `blocks`: E/ep experts of each MoE block."""
    one = sum(n for n, _ in moe_layer_sizes(model, tp)["expert"])
    return moe_blocks_of(model, blocks) * model.num_experts // ep * one


def kept_rows(model, batch: int, cp: int) -> float:
    """Choices a rank keeps per micro-batch and MoE block under balanced routing: each
    sequence keeps min(k T, E capacity), of which this rank routes 1/cp."""
    k, T, E = model.moe_top_k, model.seq_len, model.num_experts
    limit = capacity(model.moe_capacity_factor, k, T, E)
    per_sequence = min(k * T, E * limit) if limit else k * T
    return batch * per_sequence / cp


def moe_traffic(model, parallel, train, rank, add) -> None:
    """add(key, bytes, calls) what the MoE blocks of this rank's stage move in one
    iteration, per micro-batch and MoE block (forwards: 2 under full recomputation):
    the counts' all-to-all, E integers, once a forward; four all_to_allv a pass (dispatch
    and combine forward, their backwards), each S = (ep - 1)/ep of the kept rows of C
    values; over tp, the experts' g and f over their kept rows instead of the dense MLP's
    over B T/cp rows, and the shared experts' own (under sp the layer gathers its input
    and output gradient, and slices its output: no reduce-scatter); over cp, the router's all-gather of
    the choices (int64) and all-reduce of P (B x E). Once a step: the routing log
    (2 + E float64 a block) summed over dp x cp and pp."""
    item, C, E, k = model.itemsize, model.d_model, model.num_experts, model.moe_top_k
    m, B, T = train.num_microbatches(rank.dp), train.micro_batch_size, model.seq_len // rank.cp
    forwards = 1 + (parallel.recompute == "full")
    blocks = m * moe_blocks_of(model, rank.blocks(model.n_layers))
    kept = kept_rows(model, B, rank.cp)
    if rank.ep > 1:
        add("ep.all_to_all", blocks * forwards * half_bytes(E * COUNT_ITEM, rank.ep), blocks * forwards)
        sent = kept * (rank.ep - 1) / rank.ep * C * item
        add("ep.all_to_allv", blocks * 2 * (forwards + 1) * sent, blocks * 2 * (forwards + 1))
    if rank.tp > 1:
        tp_kind = "tp.reduce_scatter" if parallel.sequence_parallel else "tp.all_reduce"
        act = all_reduce_bytes(B * T * C * item, rank.tp)
        dense_mlp = half_bytes(B * T * C * item, rank.tp) if parallel.sequence_parallel else act
        add(tp_kind, -blocks * (forwards + 1) * dense_mlp, -blocks * (forwards + 1))       # no dense MLP
        add("tp.all_reduce", blocks * (forwards + 1) * all_reduce_bytes(kept * C * item, rank.tp),
            blocks * (forwards + 1))
        if model.moe_shared_experts:
            add(tp_kind, blocks * (forwards + 1) * dense_mlp, blocks * (forwards + 1))
        if parallel.sequence_parallel:      # the layer gathers x and dy: one gather fewer than the dense MLP's
            gather = half_bytes(B * T * C * item, rank.tp)
            add("tp.all_gather", blocks * ((2 + forwards) * bool(model.moe_shared_experts) - 1) * gather,
                blocks * ((2 + forwards) * bool(model.moe_shared_experts) - 1))
    if rank.cp > 1:
        add("cp.all_gather", blocks * forwards * half_bytes(rank.cp * B * T * k * COUNT_ITEM, rank.cp), blocks * forwards)
        add("cp.all_reduce", blocks * forwards * all_reduce_bytes(B * E * item, rank.cp), blocks * forwards)
    log = (2 + E) * model.n_layers * LOG_ITEM
    add("dp_cp.all_reduce", all_reduce_bytes(log, rank.dp * rank.cp))
    add("pp.all_reduce", all_reduce_bytes(log, rank.pp))


def expert_gradient_traffic(model, parallel, rank, add, items, buckets) -> None:
    """add() the expert buffer's gradient reduction (docs/13-experts.md): an all-reduce
    over expert_dp under ZeRO-0; from ZeRO-1 on (stage 2 at most), and with
    --hierarchical-all-reduce, a reduce-scatter of the padded buffer over the expert_dp
    ranks of one replica (expert_dp_shard), the slice's all-reduce over the replicas
    (dp_replica, under hybrid sharding) and the all-gather of the updated parameters;
    then the gradient norm's one float64, over the ranks holding one copy of every
    expert (tp x pp x ep) or, sharded, over one replica's ranks (dp_shard_model)."""
    param_item, grad_item = items
    group, replicas = rank.expert_shard_group, rank.replicas
    elements = expert_elements(model, rank.blocks(model.n_layers), rank.tp, rank.ep)
    padded = pad_to_multiple(elements, group)
    if parallel.zero_stage == 0 and not parallel.hierarchical_all_reduce:
        add("expert_dp.all_reduce", all_reduce_bytes(elements * grad_item, rank.expert_dp), buckets)
    else:             # the two halves of one all-reduce (--hierarchical-all-reduce's too)
        add("expert_dp_shard.reduce_scatter", half_bytes(padded * grad_item, group),
            buckets if parallel.zero_stage >= 2 else 1)
        add("dp_replica.all_reduce", all_reduce_bytes(padded // group * grad_item, replicas))
        add("expert_dp_shard.all_gather", half_bytes(padded * (param_item if parallel.zero_stage else grad_item), group))
    if parallel.zero_stage == 0:
        add("expert_model.all_reduce", all_reduce_bytes(8, rank.tp * rank.pp * rank.ep))
    else:
        add("dp_shard_model.all_reduce", all_reduce_bytes(8, rank.tp * rank.pp * rank.dp * rank.cp // replicas))


def moe_flops_delta(model, tokens: int, forwards: int = 1) -> float:
    """What the MoE blocks change in a step's matmul FLOPs over `tokens` tokens (forward
    2, backward 4 per weight element and row, `forwards` forward passes): a token's kept
    routed choices (k, or fewer when a capacity drops some: kept_rows) and its N shared
    experts, two C x h matrices each, and the router (C x E), in place of the dense MLP
    (two C x 4C)."""
    C, h = model.d_model, model.expert_hidden
    routed = kept_rows(model, 1, 1) / model.seq_len             # kept choices per token
    per_token = 4 * C * h * (routed + model.moe_shared_experts) + 2 * C * model.num_experts - 16 * C * C
    moe_blocks = sum(map(model.is_moe_block, range(model.n_layers)))
    return (2 + forwards) * tokens * moe_blocks * per_token


def moe_block_work(model, batch: int, cp: int, tp: int, recompute: str):
    """One MoE block's compute on a rank per micro-batch, less the dense block's MLP that
    kernels.block_work counted: the experts' MLPs over its kept rows (balanced
    routing), the shared experts over its tokens, the router's matmul."""
    rows, C, h = batch * model.seq_len // cp, model.d_model, model.expert_hidden
    work = mlp_work(kept_rows(model, batch, cp), C, h // tp, recompute)
    if model.moe_shared_experts:
        work += mlp_work(rows, C, model.moe_shared_experts * h // tp, recompute)
    router = Work()
    router.mm(rows, C, model.num_experts, times=3 + (recompute == "full"))
    work += router
    work += mlp_work(rows, C, 4 * C // tp, recompute).scaled(-1)
    return work


def moe_activation_delta(model, batch: int, T: int, tp: int, ep: int, sequence_parallel: bool, recompute: str) -> int:
    """What one MoE block's caches keep per micro-batch beyond a dense block's (T: this
    rank's tokens of a sequence), with K its kept rows (balanced routing). Kept: the
    router's input x (n C) and probabilities (n E), its argsort of the E scores (int64;
    `chosen` is a view of it), the gates (n k), the kept mask (n k, bool), the loads (E,
    int64) and f (B E); the experts' input and two hidden arrays (K C + 2 K h/tp), the
    rows' order (K, int64), the counts (2 ep + E/ep, int64), each kept choice's token and
    slot (2 K, int64) and output (K C); the shared experts' two hidden arrays (2 n N h/tp),
    and under sp their own input (this rank's n/tp rows; x is the gathered copy).
    Less the dense MLP's input and two hidden arrays, n C + 2 n 4C/tp. Full recomputation
    keeps only the block's input, as for a dense block."""
    if recompute == "full":
        return 0
    item, C, E, k, h = model.itemsize, model.d_model, model.num_experts, model.moe_top_k, model.expert_hidden
    n, K = batch * T, kept_rows(model, batch, model.seq_len // T)
    floats = n * C + n * E + n * k + batch * E + K * C + 2 * K * h // tp + K * C \
        + 2 * n * model.moe_shared_experts * h // tp \
        + (n // tp * C if sequence_parallel and model.moe_shared_experts else 0)
    ints = 8 * (n * E + E + K + 2 * ep + E // ep + 2 * K) + n * k
    dense_mlp = (n // tp if sequence_parallel else n) * C + 2 * n * 4 * C // tp
    return item * (floats - dense_mlp) + ints
