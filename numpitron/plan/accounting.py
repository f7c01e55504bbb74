"""Bytes a rank stores and moves in one training iteration, computed from the configs
and the mesh alone: one function per quantity, each term named after the strategy
that adds it. Tests compare every figure with what a real run counts (`ParamStore`,
the optimizer, `CommStats`, `PipelineStats.peak_activation_bytes`), to the byte.

A rank is described by its stage (pp_rank), the placement of the virtual stages on
the pipeline's ranks (the model's own `StagePlacement`: a loop, or a V whose rank 0
holds both the embeddings and the head) and its cp_rank; tp, dp ranks do not change
these figures.
"""

import math
from dataclasses import dataclass
from functools import cache

from numpitron.distributed.sharding import pad_to_multiple, pieces_of_range
from numpitron.distributed.stages import StagePlacement
from numpitron.distributed.topology import Topology
from numpitron.nn.activation_memory import block_activation_bytes
from numpitron.nn.block import Block
from numpitron.nn.embedding import PositionEmbedding, VocabParallelEmbedding
from numpitron.nn.head import LanguageModelHead
from numpitron.optim.muon import is_hidden_matrix, matrix_shape
from numpitron.parallel.schedules import BACKWARD, FORWARD, WEIGHT_GRAD, make_schedule, placement_of

F64 = 8          # the loss and the squared gradient norm travel as one float64


@dataclass(frozen=True)
class Rank:
    tp: int
    pp: int
    dp: int
    cp: int
    stage: int = 0
    cp_rank: int = 0
    dp_rank: int = 0               # only ZeRO-3's traffic depends on it (where the slices fall)
    dp_shard: int = 0              # HSDP's S (0: dp): ZeRO shards over cp x S ranks, dp / S replicas
    placement: StagePlacement | None = None     # None: one stage a rank, in a line
    tp_rank: int = 0               # only Muon's owners depend on it (plan/muon_cost.py)

    @classmethod
    def of(cls, topo, parallel) -> "Rank":
        """This process's rank, its virtual stages placed as `parallel`'s schedule places them."""
        return cls(topo.tp, topo.pp, topo.dp, topo.cp, topo.pp_rank, topo.cp_rank, topo.dp_rank, topo.dp_shard,
                   placement_of(parallel.schedule, topo.pp, parallel.virtual_stages), topo.tp_rank)

    @property
    def stages(self) -> StagePlacement:
        return self.placement or StagePlacement(self.pp)

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO shards over: cp x S (dp_shard)."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def shard_rank(self) -> int:
        """This rank's place in its shard group, whose slice [r/g, (r+1)/g) it keeps: dp
        ranks come in replicas of S consecutive ones (distributed/topology.py)."""
        return self.dp_rank % (self.dp_shard or self.dp) * self.cp + self.cp_rank

    @property
    def replicas(self) -> int:
        """Copies of each shard, averaged across them: dp / S (dp_replica)."""
        return self.dp // (self.dp_shard or self.dp)

    def holds_embeddings(self, chunk: int) -> bool:
        return self.stages.stage(self.stage, chunk) == 0

    def holds_head(self, chunk: int) -> bool:
        return self.stages.stage(self.stage, chunk) == self.stages.stages - 1

    @property
    def first(self) -> bool:
        """Holds the embeddings (virtual stage 0)."""
        return self.stages.rank_of(0) == self.stage

    @property
    def last(self) -> bool:
        """Holds the head (the last virtual stage): rank p - 1 of a loop, rank 0 of a V."""
        return self.stages.rank_of(self.stages.stages - 1) == self.stage

    def pipeline_messages(self) -> int:
        """Messages this rank sends in each direction per micro-batch (and receives as
        many): each of its virtual stages sends its activations on and its input
        gradient back, but where the neighbour is on this rank (the bottom of a V)."""
        placed = self.stages
        neighbours = [j + step for c in range(placed.v) for j in [placed.stage(self.stage, c)] for step in (1, -1)]
        return sum(0 <= k < placed.stages and placed.rank_of(k) != self.stage for k in neighbours)


def _all_reduce(nbytes: float, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * nbytes


def _half(nbytes: float, ranks: int) -> float:
    """An all-gather or a reduce-scatter of a full buffer of nbytes over `ranks` ranks."""
    return (ranks - 1) / ranks * nbytes


@cache
def layer_elements(model, tp: int) -> dict:
    """{piece: (elements on one tp rank, of which tp-replicated)} for a block, the token
    embedding, the position embedding and the head (its ln_f), counted from the layers'
    own Params: built as tp rank 0 of a mesh without communicators (every tp rank holds
    as many), never allocated."""
    topo, C = Topology(None, tp, 1, 1), model.d_model
    token = VocabParallelEmbedding("embedding.token", model.vocab_size, C, topo)
    pieces = {"block": Block("blocks.0", C, model.n_heads, model.n_layers, topo), "token": token,
              "position": PositionEmbedding("embedding.position", model.seq_len, C),
              "head": LanguageModelHead(token, C, topo)}
    return {piece: (sum(math.prod(p.local_shape) for p in layer.parameters()),
                    sum(math.prod(p.local_shape) for p in layer.parameters() if p.split_axis is None))
            for piece, layer in pieces.items()}


@cache
def moe_block_elements(model) -> tuple[int, int]:
    """(every parameter, the ones one token uses) of an MoE block, counted from its
    layers' Params on one rank (never allocated): attention, the router, every expert
    and the shared experts; a token runs top-k of the E routed experts."""
    topo = Topology(None, 1, 1, 1)
    moe = dict(num_experts=model.num_experts, top_k=model.moe_top_k, capacity_factor=model.moe_capacity_factor,
               aux_loss_coef=0.0, shared_experts=model.moe_shared_experts, expert_hidden=model.moe_expert_hidden)
    block = Block("blocks.0", model.d_model, model.n_heads, model.n_layers, topo, moe=moe)
    every = sum(math.prod(p.local_shape) for p in block.parameters())
    one_expert = sum(math.prod(p.local_shape) for p in block.mlp.experts.mlps[0].parameters())
    return every, every - (model.num_experts - model.moe_top_k) * one_expert


def parameter_elements(model, rank: Rank) -> tuple[int, int]:
    """(elements of this rank's slice of its stage, of which tp-replicated): its blocks,
    the token embedding on the first and last stage (one copy each, one in all when
    one rank holds both, as rank 0 of a V), the positions on the first, ln_f on the last."""
    layers = layer_elements(model, rank.tp)
    copies = {"block": model.n_layers // rank.pp, "token": int(rank.first or rank.last),
              "position": int(rank.first), "head": int(rank.last)}
    return tuple(sum(count * layers[piece][i] for piece, count in copies.items()) for i in (0, 1))


def block_elements(model, tp: int) -> int:
    """One transformer block's parameters on a tp rank: the ZeRO-3 unit."""
    return layer_elements(model, tp)["block"][0]


@cache
def block_matrix_spans(model, tp: int) -> tuple[int, tuple]:
    """A block's elements on one tp rank, and the [start, stop) within it of each matrix
    Muon updates (optim/muon.py: `is_hidden_matrix`), in the order of the flat buffer,
    with the matrix's whole (A, B) shape."""
    block, spans, offset = Block("blocks.0", model.d_model, model.n_heads, model.n_layers, Topology(None, tp, 1, 1)), [], 0
    for p in block.parameters():
        n = math.prod(p.local_shape)
        if is_hidden_matrix(p):
            spans.append((offset, offset + n, matrix_shape(p)))
        offset += n
    return offset, tuple(spans)


def stage_matrices(model, rank: Rank) -> list[tuple[int, int, tuple]]:
    """Muon's matrices in this rank's stage's flat buffer, as (start, stop, shape): the
    buffer is the token embedding (first and last stage), the positions (first), then
    the blocks, then ln_f (last)."""
    layers = layer_elements(model, rank.tp)
    start = layers["token"][0] * (rank.first or rank.last) + layers["position"][0] * rank.first
    block, spans = block_matrix_spans(model, rank.tp)
    return [(start + k * block + a, start + k * block + b, shape)
            for k in range(model.n_layers // rank.pp) for a, b, shape in spans]


def muon_elements(model, rank: Rank, lo: int, hi: int) -> int:
    """Elements of Muon's matrices inside [lo, hi) of this rank's stage."""
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b, _ in stage_matrices(model, rank))


def optimizer_state_elements(model, rank: Rank, lo: int, hi: int, optimizer: str) -> int:
    """AdamW keeps two moments per element of [lo, hi); Muon one on its matrices."""
    return 2 * (hi - lo) - (muon_elements(model, rank, lo, hi) if optimizer == "muon" else 0)


def state_bytes(model, parallel, rank: Rank, optimizer: str = "adamw") -> dict:
    """The optimizer's `memory_bytes` on this rank (Rajbhandari et al. 2020, Fig. 1).
    Kept all run: parameters, gradients, Adam's m and v (Muon: one moment on its
    matrices, `optimizer_state_elements`). ZeRO pads the flat buffer to
    a multiple of the shard group g = S x cp (S = dp unless hybrid sharding makes it
    smaller; `--hierarchical-all-reduce` pads plain dp's the same way) and keeps 1/g
    of: m and v (stage 1, which adds
    a 1/g gradient slice), the gradients too (stage 2), and the parameters (stage 3).
    Alive only during a pass: the whole gradient buffer (stage 2), the gathered layers
    and their gradients (stage 3: the root, and two blocks, one computing while the
    next is prefetched or the last is reduce-scattered; one without overlap). The peak
    is the sum."""
    item, group, stage = model.itemsize, rank.shard_group, parallel.zero_stage
    size = parameter_elements(model, rank)[0]
    if stage == 0:
        size = pad_to_multiple(size, group) if parallel.hierarchical_all_reduce else size
        return {"params": size * item, "grads": size * item,
                "optimizer_state": optimizer_state_elements(model, rank, 0, size, optimizer) * item,
                "gathered_params_peak": 0, "backward_grads_peak": 0}
    padded = pad_to_multiple(size, group)
    shard, group_rank = padded // group, rank.shard_rank
    blocks = model.n_layers // rank.pp
    whole = min(2 if parallel.overlap_grad_reduce else 1, blocks)        # no prefetch: one at a time
    in_pass = padded - blocks * block_elements(model, rank.tp) + whole * block_elements(model, rank.tp)
    return {"params": (shard if stage == 3 else padded) * item,
            "grads": (shard + (padded if stage == 1 else 0)) * item,
            "optimizer_state": optimizer_state_elements(model, rank, group_rank * shard, (group_rank + 1) * shard,
                                                        optimizer) * item,
            "gathered_params_peak": in_pass * item if stage == 3 else 0,
            "backward_grads_peak": {1: 0, 2: padded, 3: in_pass}[stage] * item}


def chunk_activation_bytes(model, parallel, train, rank: Rank, chunk: int = 0) -> int:
    """What one micro-batch's caches keep in one chunk of this stage (docs/09 and docs/13
    derive it): its n_layers / (p v) blocks, the embeddings in virtual stage 0, the head
    in the last."""
    item, tp = model.itemsize, rank.tp
    B, T, C = train.micro_batch_size, model.seq_len // rank.cp, model.d_model
    tokens, split = B * T, (tp if parallel.sequence_parallel else 1)
    total = (model.n_layers // rank.stages.stages) * block_activation_bytes(
        B, T, C, model.n_heads, tp, parallel.sequence_parallel, parallel.recompute, item, rank.cp, rank.cp_rank)
    if rank.holds_embeddings(chunk):    # token rows (int64), owned mask (bool), the positions (int64)
        total += 9 * tokens + 8 * T
    if rank.holds_head(chunk):          # ln_f (x-hat, 1/std), the head's input, the loss's probabilities
        n = tokens // split
        total += item * (2 * n * C + n + tokens * pad_to_multiple(model.vocab_size, tp) // tp) + 9 * tokens
    return total


def peak_activation_bytes(model, parallel, train, rank: Rank) -> int:
    """Walk this stage's schedule: a chunk's caches live from its forward to its whole
    backward (BW) or its weight half (W); the peak of their sum."""
    m, alive, peak = train.num_microbatches(rank.dp), 0, 0
    for op in make_schedule(parallel.schedule, m, rank.pp, rank.stage, parallel.virtual_stages):
        nbytes = chunk_activation_bytes(model, parallel, train, rank, op.chunk)
        alive += nbytes if op.action == FORWARD else -nbytes if op.action in (BACKWARD, WEIGHT_GRAD) else 0
        peak = max(peak, alive)
    return peak


def comm_bytes(model, parallel, train, rank: Rank) -> dict:
    """{"<group>.<kind>": bytes} this rank moves in one training iteration."""
    item, tp, cp, pp = model.itemsize, rank.tp, rank.cp, rank.pp
    m, B, C, L = train.num_microbatches(rank.dp), train.micro_batch_size, model.d_model, model.n_layers // pp
    # L: blocks on this rank, all its chunks together
    T = model.seq_len // cp
    act, sp, full = B * T * C * item, parallel.sequence_parallel, parallel.recompute == "full"
    out = {}

    def add(key, nbytes):
        if nbytes:
            out[key] = out.get(key, 0.0) + nbytes
    if tp > 1:                       # per micro-batch, then times m
        if sp:       # gathers and reduce-scatters along the sequence (nn/regions.py)
            gathers = L * (6 + 2 * full) + (1 if rank.first else 0) + (2 if rank.last else 0)
            scatters = L * (4 + 2 * full) + (1 if rank.first else 0) + (1 if rank.last else 0)
            add("tp.all_gather", m * gathers * _half(act, tp))
            add("tp.reduce_scatter", m * scatters * _half(act, tp))
            add("tp.all_reduce", _all_reduce(parameter_elements(model, rank)[1] * item, tp))
        else:        # Megatron's f and g: all-reduces
            reduces = L * (4 + 2 * full) + (1 if rank.first else 0) + (1 if rank.last else 0)
            add("tp.all_reduce", m * reduces * _all_reduce(act, tp))
        if rank.last:                # the loss: row max, target logit, sum of exponentials
            add("tp.all_reduce", m * 3 * _all_reduce(B * T * item, tp))
    if cp > 1:                       # the ring: K, V forward; K, V and dK, dV backward
        block = act // tp
        sends = m * L * (2 * (cp - 1) * (2 + full) + 2 * cp) * block
        add("cp.send", sends)
        add("cp.recv", sends)
    if pp > 1:
        hop = B * (T // (tp if sp else 1)) * C * item
        add("pp.send", m * hop * rank.pipeline_messages())
        add("pp.recv", m * hop * rank.pipeline_messages())
        add("pp.broadcast", F64)     # the loss, from the head's stage
        if rank.first != rank.last:  # the tied embedding's two copies (one, on rank 0, in a V)
            add("embedding.all_reduce", _all_reduce(layer_elements(model, tp)["token"][0] * item, 2))
    elements, group, replicas = parameter_elements(model, rank)[0], rank.shard_group, rank.replicas
    padded, sharded = pad_to_multiple(elements, group), parallel.zero_stage or parallel.hierarchical_all_reduce
    if parallel.zero_stage == 0 and not parallel.hierarchical_all_reduce:
        add("dp_cp.all_reduce", _all_reduce(elements * item, rank.dp * cp))
    elif parallel.zero_stage in (0, 1, 2):          # the two halves of one all-reduce inside the shard group
        add("dp_shard.reduce_scatter", _half(padded * item, group))
        add("dp_shard.all_gather", _half(padded * item, group))
    else:
        gathered, scattered = _zero3_elements_moved(model, rank, m, padded)
        add("dp_shard.all_gather", gathered * item)
        add("dp_shard.reduce_scatter", scattered * item)
    if sharded:                                     # each slice averaged over its replicas (HSDP)
        add("dp_replica.all_reduce", _all_reduce(padded // group * item, replicas))
    add("dp_cp.all_reduce", _all_reduce(F64, rank.dp * cp))          # the loss
    if parallel.zero_stage >= 1:                    # the norm over one replica's ranks
        add("dp_shard_model.all_reduce", _all_reduce(F64, tp * cp * pp * rank.dp // replicas))
    elif tp * pp > 1:
        add("model.all_reduce", _all_reduce(F64, tp * pp))            # the gradient norm
    return out


def _zero3_elements_moved(model, rank: Rank, m: int, padded: int) -> tuple[int, int]:
    """Elements this rank receives in ZeRO-3's all-gathers and sends away in its
    reduce-scatters in one step (parallel/zero3.py): every unit's elements outside this
    rank's slice; the root (embeddings and final LayerNorm, with the padding) once,
    each block in m forwards and m backwards (gathered twice, reduced once). A single
    stage (ZeRO-3 refuses pipelines): the root is the head and the tail of the buffer."""
    group = rank.shard_group
    group_rank = rank.dp_rank % (group // rank.cp) * rank.cp + rank.cp_rank
    pieces = layer_elements(model, rank.tp)
    block, head = pieces["block"][0], pieces["token"][0] + pieces["position"][0]
    layers = model.n_layers

    def outside(a, b):
        return (b - a) - pieces_of_range(a, b, padded, group)[group_rank]
    root = outside(0, head) + outside(head + layers * block, padded)
    blocks = sum(outside(head + i * block, head + (i + 1) * block) for i in range(layers))
    return root + 2 * m * blocks, root + m * blocks
