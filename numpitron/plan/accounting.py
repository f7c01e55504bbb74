"""Bytes a rank stores and moves in one training iteration, computed from the configs
and the mesh alone: one function per quantity, each term named after the strategy
that adds it. Tests compare every figure with what a real run counts (`ParamStore`,
the optimizer, `CommStats`, `PipelineStats.peak_activation_bytes`), to the byte.

A rank is described by its stage (pp_rank) and cp_rank; tp, dp ranks do not change
these figures.
"""

import math
from dataclasses import dataclass
from functools import cache

from numpitron.distributed.sharding import pad_to_multiple, pieces_of_range
from numpitron.distributed.topology import Topology
from numpitron.nn.activation_memory import block_activation_bytes
from numpitron.nn.block import Block
from numpitron.nn.embedding import PositionEmbedding, VocabParallelEmbedding
from numpitron.nn.head import LanguageModelHead
from numpitron.optim.muon import is_hidden_matrix
from numpitron.parallel.schedules import BACKWARD, FORWARD, WEIGHT_GRAD, make_schedule

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

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1


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


def parameter_elements(model, rank: Rank) -> tuple[int, int]:
    """(elements of this rank's slice of its stage, of which tp-replicated): its blocks,
    the token embedding on the first and last stage (one copy each), the positions on
    the first, ln_f on the last."""
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
    Muon updates (optim/muon.py: `is_hidden_matrix`), in the order of the flat buffer."""
    block, spans, offset = Block("blocks.0", model.d_model, model.n_heads, model.n_layers, Topology(None, tp, 1, 1)), [], 0
    for p in block.parameters():
        n = math.prod(p.local_shape)
        if is_hidden_matrix(p):
            spans.append((offset, offset + n))
        offset += n
    return offset, tuple(spans)


def muon_elements(model, rank: Rank, lo: int, hi: int) -> int:
    """Elements of Muon's matrices inside [lo, hi) of this rank's stage: the stage's
    flat buffer is the token embedding (first and last stage), the positions (first),
    then the blocks, then ln_f (last)."""
    layers = layer_elements(model, rank.tp)
    start = layers["token"][0] * (rank.first or rank.last) + layers["position"][0] * rank.first
    block, spans = block_matrix_spans(model, rank.tp)
    inside = 0
    for k in range(model.n_layers // rank.pp):
        for a, b in spans:
            a, b = start + k * block + a, start + k * block + b
            inside += max(0, min(b, hi) - max(a, lo))
    return inside


def optimizer_state_elements(model, rank: Rank, lo: int, hi: int, optimizer: str) -> int:
    """AdamW keeps two moments per element of [lo, hi); Muon one on its matrices."""
    return 2 * (hi - lo) - (muon_elements(model, rank, lo, hi) if optimizer == "muon" else 0)


def state_bytes(model, parallel, rank: Rank, optimizer: str = "adamw") -> dict:
    """The optimizer's `memory_bytes` on this rank (Rajbhandari et al. 2020, Fig. 1).
    Kept all run: parameters, gradients, Adam's m and v (Muon: one moment on its
    matrices, `optimizer_state_elements`). ZeRO pads the flat buffer to
    a multiple of the group g = dp x cp and keeps 1/g of: m and v (stage 1, which adds
    a 1/g gradient slice), the gradients too (stage 2), and the parameters (stage 3).
    Alive only during a pass: the whole gradient buffer (stage 2), the gathered layers
    and their gradients (stage 3: the root, and two blocks, one computing while the
    next is prefetched or the last is reduce-scattered; one without overlap). The peak
    is the sum."""
    item, group, stage = model.itemsize, rank.dp * rank.cp, parallel.zero_stage
    size = parameter_elements(model, rank)[0]
    if stage == 0:
        return {"params": size * item, "grads": size * item,
                "optimizer_state": optimizer_state_elements(model, rank, 0, size, optimizer) * item,
                "gathered_params_peak": 0, "backward_grads_peak": 0}
    padded = pad_to_multiple(size, group)
    shard, group_rank = padded // group, rank.dp_rank * rank.cp + rank.cp_rank
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
    item, tp, v = model.itemsize, rank.tp, parallel.virtual_stages
    B, T, C = train.micro_batch_size, model.seq_len // rank.cp, model.d_model
    tokens, split = B * T, (tp if parallel.sequence_parallel else 1)
    total = (model.n_layers // (rank.pp * v)) * block_activation_bytes(
        B, T, C, model.n_heads, tp, parallel.sequence_parallel, parallel.recompute, item, rank.cp, rank.cp_rank)
    if rank.first and chunk == 0:       # token rows (int64), owned mask (bool), the positions (int64)
        total += 9 * tokens + 8 * T
    if rank.last and chunk == v - 1:    # ln_f (x-hat, 1/std), the head's input, the loss's probabilities
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
        # Each chunk sends its activations on (but the last virtual stage) and its input
        # gradient back (but virtual stage 0): interleaving multiplies the messages by v.
        virtual = [c * pp + rank.stage for c in range(parallel.virtual_stages)]
        messages = sum((j < pp * parallel.virtual_stages - 1) + (j > 0) for j in virtual)
        add("pp.send", m * hop * messages)
        add("pp.recv", m * hop * messages)
        add("pp.broadcast", F64)     # the loss, from the last stage
        if rank.first or rank.last:  # the tied embedding's two copies
            add("embedding.all_reduce", _all_reduce(layer_elements(model, tp)["token"][0] * item, 2))
    group, elements = rank.dp * cp, parameter_elements(model, rank)[0]
    if group > 1:
        padded = pad_to_multiple(elements, group)
        if parallel.zero_stage == 0:
            add("dp_cp.all_reduce", _all_reduce(elements * item, group))
        elif parallel.zero_stage in (1, 2):          # the two halves of one all-reduce
            add("dp_cp.reduce_scatter", _half(padded * item, group))
            add("dp_cp.all_gather", _half(padded * item, group))
        else:
            gathered, scattered = _zero3_elements_moved(model, rank, m, padded)
            add("dp_cp.all_gather", gathered * item)
            add("dp_cp.reduce_scatter", scattered * item)
        add("dp_cp.all_reduce", _all_reduce(F64, group))          # the loss
    world = tp * cp * pp * rank.dp
    if parallel.zero_stage >= 1:
        add("world.all_reduce", _all_reduce(F64, world) if world > 1 else 0)
    elif tp * pp > 1:
        add("model.all_reduce", _all_reduce(F64, tp * pp))            # the gradient norm
    return out


def _zero3_elements_moved(model, rank: Rank, m: int, padded: int) -> tuple[int, int]:
    """Elements this rank receives in ZeRO-3's all-gathers and sends away in its
    reduce-scatters in one step (parallel/zero3.py): every unit's elements outside this
    rank's slice; the root (embeddings and final LayerNorm, with the padding) once,
    each block in m forwards and m backwards (gathered twice, reduced once). A single
    stage (ZeRO-3 refuses pipelines): the root is the head and the tail of the buffer."""
    group_rank, group = rank.dp_rank * rank.cp + rank.cp_rank, rank.dp * rank.cp
    pieces = layer_elements(model, rank.tp)
    block, head = pieces["block"][0], pieces["token"][0] + pieces["position"][0]
    layers = model.n_layers

    def outside(a, b):
        return (b - a) - pieces_of_range(a, b, padded, group)[group_rank]
    root = outside(0, head) + outside(head + layers * block, padded)
    blocks = sum(outside(head + i * block, head + (i + 1) * block) for i in range(layers))
    return root + 2 * m * blocks, root + m * blocks
