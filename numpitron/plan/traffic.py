"""Bytes and calls a rank moves over each of its groups in one training iteration,
from the configs and the mesh alone (a rank as plan/accounting.py describes it). Tests
compare each figure with what a real run's `CommStats` counts, to the byte."""

from numpitron.distributed.sharding import pad_to_multiple, pieces_of_range
from numpitron.plan.collective_bytes import all_reduce_bytes as _all_reduce, half_bytes as _half
from numpitron.plan.experts import expert_elements, expert_gradient_traffic, moe_traffic
from numpitron.plan.layer_sizes import block_piece, layer_elements, layer_parameter_sizes
from numpitron.precision.formats import FORMATS
from numpitron.plan.accounting import F64, Rank, block_elements, parameter_elements
from numpitron.plan.slow_links import compressed_traffic, diloco_traffic


def comm_bytes(model, parallel, train, rank: Rank) -> dict:
    """{"<group>.<kind>": bytes} this rank moves in one training iteration."""
    return {kind: nbytes for kind, (nbytes, _) in comm_traffic(model, parallel, train, rank).items()}


def comm_calls(model, parallel, train, rank: Rank) -> dict:
    """{"<group>.<kind>": calls} this rank makes in one training iteration: each call
    pays its latency once per message of its algorithm (plan/predict.py)."""
    return {kind: calls for kind, (_, calls) in comm_traffic(model, parallel, train, rank).items()}


def gradient_buckets(model, rank: Rank, bucket_size: int, padding: int = 0, experts: bool = False) -> int:
    """Buckets of the data-parallel reduction (data_parallel/buckets.py): walking this
    stage's flat buffer (token embedding, positions, blocks, ln_f; or, `experts`, the
    expert buffer: E/ep experts of each MoE block) from the end, one is cut at a
    parameter's start once it holds bucket_size elements (the padding rides in the
    first), the rest go in the last."""
    sizes, blocks = layer_parameter_sizes(model, rank.tp), rank.blocks(model.n_layers)
    copies = [("token", rank.first or rank.last), ("position", rank.first),
              *[(block_piece(model, b), True) for b in blocks], ("head", rank.last)]
    if experts:
        copies = [("expert", True)] * (sum(map(model.is_moe_block, blocks)) * model.num_experts // rank.ep)
    params = [n for piece, held in copies if held for n, _ in sizes[piece]]
    buckets, hi, lo = 0, sum(params) + padding, sum(params)
    for n in reversed(params):
        lo -= n
        if hi - lo >= bucket_size or lo == 0:
            buckets, hi = buckets + 1, lo
    return buckets


def comm_traffic(model, parallel, train, rank: Rank) -> dict:
    """{"<group>.<kind>": (bytes, calls)} of one training iteration on this rank. Mixed precision
    (docs/07-numbers.md): dp gathers parameters in the low format, 2 bytes an element,
    and sums gradients in it or in fp32 (--grad-reduce-dtype: `grad_item`); activations
    travel as the float32 arrays that hold them here. DiLoCo and compressed gradients:
    plan/slow_links.py."""
    if getattr(train, "diloco_replicas", 0) > 1:
        return diloco_traffic(model, parallel, train, rank, comm_traffic)
    item, tp, cp, pp = model.itemsize, rank.tp, rank.cp, rank.pp
    fmt = FORMATS[getattr(train, "precision", "fp32")]
    param_item = fmt.itemsize if fmt.mixed else item
    grad_item = param_item if getattr(train, "grad_reduce_dtype", "fp32") == "param" else item
    m, B, C, L = train.num_microbatches(rank.dp), train.micro_batch_size, model.d_model, model.n_layers // pp
    # L: blocks on this rank, all its chunks together
    T = model.seq_len // cp
    act, sp, full = B * T * C * item, parallel.sequence_parallel, parallel.recompute == "full"
    out = {}

    def add(key, nbytes, calls=1):        # negative: a term an MoE block replaces
        if nbytes:
            was = out.get(key, (0.0, 0))
            out[key] = (was[0] + nbytes, was[1] + calls)
    if tp > 1:                       # per micro-batch, then times m
        if sp:       # gathers and reduce-scatters along the sequence (tensor_parallel/regions.py)
            gathers = L * (6 + 2 * full) + (1 if rank.first else 0) + (2 if rank.last else 0)
            scatters = L * (4 + 2 * full) + (1 if rank.first else 0) + (1 if rank.last else 0)
            add("tp.all_gather", m * gathers * _half(act, tp), m * gathers)
            add("tp.reduce_scatter", m * scatters * _half(act, tp), m * scatters)
            add("tp.all_reduce", _all_reduce(parameter_elements(model, rank)[1] * item, tp))
        else:        # Megatron's f and g: all-reduces
            reduces = L * (4 + 2 * full) + (1 if rank.first else 0) + (1 if rank.last else 0)
            add("tp.all_reduce", m * reduces * _all_reduce(act, tp), m * reduces)
        if rank.last:                # the loss: row max, target logit, sum of exponentials
            add("tp.all_reduce", m * 3 * _all_reduce(B * T * item, tp), m * 3)
    if cp > 1:                       # the ring: K, V forward; K, V and dK, dV backward, one block a message
        messages = m * L * (2 * (cp - 1) * (2 + full) + 2 * cp)
        add("cp.send", messages * (act // tp), messages)
        add("cp.recv", messages * (act // tp), messages)
    if pp > 1:
        hop = B * (T // (tp if sp else 1)) * C * item
        add("pp.send", m * hop * rank.pipeline_messages(), m * rank.pipeline_messages())
        add("pp.recv", m * hop * rank.pipeline_messages(), m * rank.pipeline_messages())
        add("pp.broadcast", F64)     # the loss, from the head's stage
        if rank.first != rank.last:  # the tied embedding's two copies (one, on rank 0, in a V)
            add("embedding.all_reduce", _all_reduce(layer_elements(model, tp)["token"][0] * item, 2))
    elements, group, replicas = parameter_elements(model, rank)[0], rank.shard_group, rank.replicas
    padded, sharded = pad_to_multiple(elements, group), parallel.zero_stage or parallel.hierarchical_all_reduce
    buckets = gradient_buckets(model, rank, parallel.bucket_size, padded - elements if sharded else 0)
    if getattr(parallel, "grad_compression", "none") != "none":    # ZeRO-1: its padding travels, its gather stays
        add(*compressed_traffic(model, parallel, rank, grad_item, padded - elements if sharded else 0))
        if parallel.zero_stage == 1:
            add("dp_shard.all_gather", _half(padded * param_item, group))
    elif parallel.zero_stage == 0 and not parallel.hierarchical_all_reduce:
        add("dp_cp.all_reduce", _all_reduce(elements * grad_item, rank.dp * cp), buckets)
    elif parallel.zero_stage in (0, 1, 2):          # the two halves of one all-reduce inside the shard group
        add("dp_shard.reduce_scatter", _half(padded * grad_item, group), buckets if parallel.zero_stage == 2 else 1)
        add("dp_shard.all_gather", _half(padded * (param_item if parallel.zero_stage else grad_item), group))
    else:
        gathered, scattered = _zero3_elements_moved(model, rank, m, padded)
        add("dp_shard.all_gather", gathered * param_item, 2 + 2 * m * model.n_layers)    # the root's two ranges once,
        add("dp_shard.reduce_scatter", scattered * grad_item, 2 + m * model.n_layers)   # a block's one a pass
    if sharded:                                     # each slice averaged over its replicas (HSDP)
        add("dp_replica.all_reduce", _all_reduce(padded // group * grad_item, replicas))
    add("dp_cp.all_reduce", _all_reduce(F64, rank.dp * cp))          # the loss
    if parallel.zero_stage >= 1:                    # the norm over one replica's ranks
        add("dp_shard_model.all_reduce", _all_reduce(F64, tp * cp * pp * rank.dp // replicas))
    elif tp * pp > 1:
        add("model.all_reduce", _all_reduce(F64, tp * pp))            # the gradient norm
    if model.num_experts:
        moe_traffic(model, parallel, train, rank, add)
        expert_padding = 0
        if sharded:
            expert_padding = -expert_elements(model, rank.blocks(model.n_layers), tp, rank.ep) % rank.expert_shard_group
        expert_gradient_traffic(model, parallel, rank, add, (param_item, grad_item),
                                gradient_buckets(model, rank, parallel.bucket_size, expert_padding, experts=True))
    return {kind: traffic for kind, traffic in out.items() if traffic[0]}


def _zero3_elements_moved(model, rank: Rank, m: int, padded: int) -> tuple[int, int]:
    """Elements this rank receives in ZeRO-3's all-gathers and sends away in its
    reduce-scatters in one step (data_parallel/zero3.py): every unit's elements outside this
    rank's slice; the root (embeddings and final LayerNorm, with the padding) once,
    each block in m forwards and m backwards (gathered twice, reduced once). A single
    stage (ZeRO-3 refuses pipelines): the root is the head and the tail of the buffer."""
    group = rank.shard_group
    group_rank = rank.dp_rank % (group // rank.cp) * rank.cp + rank.cp_rank
    pieces, blocks = layer_elements(model, rank.tp), block_elements(model, rank)
    head = pieces["token"][0] + pieces["position"][0]
    starts = [head + sum(blocks[:i]) for i in range(len(blocks) + 1)]

    def outside(a, b):
        return (b - a) - pieces_of_range(a, b, padded, group)[group_rank]
    root = outside(0, head) + outside(starts[-1], padded)
    blocks = sum(outside(a, b) for a, b in zip(starts, starts[1:]))
    return root + 2 * m * blocks, root + m * blocks
