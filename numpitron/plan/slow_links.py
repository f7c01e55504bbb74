"""Bytes a rank moves per iteration when it trains across slow links
(docs/18-across-slow-links.md), as plan/traffic.py counts every other strategy's:

- DiLoCo (--diloco-replicas R, --diloco-inner-steps H): inside a replica, the traffic of
  a run on dp / R ranks reading the same micro-batches; across replicas, once every H
  steps, an all-reduce of the slice this rank's optimizer updates (the whole stage, or
  its ZeRO slice, which ZeRO-1/2 then gather again), 2 (R - 1) / R of it: per iteration,
  that divided by H (and so are its calls). Streaming (F fragments) sends the same
  bytes in F messages; bf16 halves them, int8 all-gathers (diloco/exchange.py). Every
  step also averages the loss over the replicas (`diloco_metrics`). Its buffers
  (`diloco_state_bytes`) and the seconds τ overlap steps hide (`hidden_outer_seconds`).
- Compressed gradients (--grad-compression) replace plain data parallelism's gradient
  all-reduce: int8 all-gathers one byte an element and one scale a parameter (two
  calls), PowerSGD all-reduces every matrix's factors P, then Q with the vectors (two).
"""

import math
from dataclasses import replace
from functools import cache

from numpitron.diloco.exchange import LEVELS, message_bytes
from numpitron.distributed.sharding import balanced_bounds, pad_to_multiple
from numpitron.distributed.topology import Topology
from numpitron.nn.embedding import PositionEmbedding
from numpitron.plan.accounting import F64, parameter_elements
from numpitron.plan.collective_bytes import all_reduce_bytes, half_bytes
from numpitron.tensor_parallel.vocab_parallel import VocabParallelEmbedding
from numpitron.transformer.block import Block
from numpitron.transformer.head import LanguageModelHead


def _replica(model, parallel, train, rank):
    """(this rank as a rank of its replica, the replica's stage buffer padded, the slice
    [lo, hi) of it this rank's optimizer updates)."""
    dp = rank.dp // train.diloco_replicas
    shard = rank.dp_shard if 0 < rank.dp_shard < dp else 0
    inner = replace(rank, dp=dp, dp_rank=rank.dp_rank % dp, dp_shard=shard)
    elements, group = parameter_elements(model, inner)[0], inner.shard_group
    padded = pad_to_multiple(elements, group) if parallel.zero_stage or parallel.hierarchical_all_reduce else elements
    held = padded // group if parallel.zero_stage else padded
    lo = inner.shard_rank * held if parallel.zero_stage else 0
    return inner, padded, lo, lo + held


def outer_exchange(model, train, padded: int, lo: int, hi: int) -> tuple[str, float, int]:
    """(kind, bytes, calls) of one round's outer exchanges on this rank: each fragment's
    piece of [lo, hi) (diloco/streaming.py), in the outer dtype (diloco/exchange.py)."""
    R, F, dtype = train.diloco_replicas, train.diloco_fragments, train.diloco_outer_dtype
    pieces = [min(b, hi) - max(a, lo) for a, b in (balanced_bounds(padded, F, p) for p in range(F))]
    pieces = [n for n in pieces if n > 0]
    if dtype in LEVELS:
        return "diloco.all_gather", (R - 1) * sum(message_bytes(n, model.itemsize, dtype) for n in pieces), len(pieces)
    item = 2 if dtype == "bf16" else model.itemsize
    return "diloco.all_reduce", sum(all_reduce_bytes(n * item, R) for n in pieces), len(pieces)


def diloco_traffic(model, parallel, train, rank, traffic) -> dict:
    """{"<group>.<kind>": (bytes, calls)} per iteration of a DiLoCo run; `traffic` is
    plan/traffic.py's comm_traffic, called for one replica."""
    R, H = train.diloco_replicas, train.diloco_inner_steps
    inner, padded, lo, hi = _replica(model, parallel, train, rank)
    # each replica reads its dp / R ranks' share of the global batch: as many micro-batches a rank
    inner_train = replace(train, diloco_replicas=0, global_batch_size=train.global_batch(rank.dp) // R)
    out = dict(traffic(model, parallel, inner_train, inner))

    def add(key, nbytes, calls):
        was = out.get(key, (0.0, 0))
        out[key] = (was[0] + nbytes, was[1] + calls)
    kind, nbytes, calls = outer_exchange(model, train, padded, lo, hi)
    add(kind, nbytes / H, calls / H)
    if parallel.zero_stage in (1, 2):           # the replica's ranks gather the new stage again, after each landing
        landings = train.diloco_fragments       # F <= H: each fragment lands at its own step
        add("dp_shard.all_gather", landings * half_bytes(padded * model.itemsize, inner.shard_group) / H, landings / H)
    add("diloco_metrics.all_reduce", all_reduce_bytes(F64, R), 1)        # the loss, averaged
    return {kind: traffic for kind, traffic in out.items() if traffic[0]}


def diloco_state_bytes(model, parallel, train, rank) -> dict:
    """DiLoCo's buffers beside the inner optimizer, over the slice it updates, in the
    parameters' format (fp32: DiLoCo runs in fp32 only): θ_start and the outer momentum,
    and with overlap (τ > 0) the mean Δ of the fragments in flight (diloco/outer.py)."""
    if not getattr(train, "diloco_replicas", 0):
        return {}
    _, _, lo, hi = _replica(model, parallel, train, rank)
    return {"diloco": (2 + (train.diloco_overlap_steps > 0)) * (hi - lo) * model.itemsize}


def hidden_outer_seconds(train, outer_seconds: float, step_compute: float) -> float:
    """Seconds per iteration of the outer exchange that τ inner steps hide: each of the
    F exchanges of a round takes outer_seconds H / F (outer_seconds is per iteration,
    amortised), and the τ steps after it compute for τ step_compute meanwhile."""
    if not getattr(train, "diloco_replicas", 0) or not train.diloco_overlap_steps:
        return 0.0
    F, H = train.diloco_fragments, train.diloco_inner_steps
    return F / H * min(outer_seconds * H / F, train.diloco_overlap_steps * step_compute)


def compressed_traffic(model, parallel, rank, item: int, padding: int = 0) -> tuple[str, float, int]:
    """(kind, bytes, calls) of one step's compressed gradient reduction over dp x cp;
    ZeRO-1's padding is one more vector (compression/segments.py)."""
    p, shapes = rank.dp * rank.cp, stage_shapes(model, rank) + ([((padding,), False)] if padding else [])
    if parallel.grad_compression == "int8":
        elements = sum(math.prod(shape) for shape, _ in shapes)
        return "dp_cp.all_gather", (p - 1) * (elements + len(shapes) * item), 2
    sent = 0
    for shape, matrix in shapes:
        if matrix:
            n, m = sorted((shape[0], math.prod(shape[1:])))
            sent += (n + m) * min(parallel.powersgd_rank, n)
        else:
            sent += math.prod(shape)
    return "dp_cp.all_reduce", all_reduce_bytes(sent * item, p), 2


def stage_shapes(model, rank) -> list[tuple[tuple, bool]]:
    """(local shape, a matrix PowerSGD factors?) of each parameter of this rank's stage:
    the token embedding (first and last stage), the positions (first), its blocks, ln_f
    (last); a matrix is what weight decay applies to (compression/segments.py)."""
    pieces, blocks = _piece_shapes(model, rank.tp), rank.blocks(model.n_layers)
    held = [("token", rank.first or rank.last), ("position", rank.first),
            *[("block", True)] * len(blocks), ("head", rank.last)]
    return [shape for piece, kept in held if kept for shape in pieces[piece]]


@cache
def _piece_shapes(model, tp: int) -> dict:
    """As plan/layer_sizes.py builds the layers (tp rank 0, no communicators, never allocated)."""
    topo, C = Topology(None, tp, 1, 1), model.d_model
    token = VocabParallelEmbedding("embedding.token", model.vocab_size, C, topo)
    layers = {"block": Block("blocks.0", C, model.n_heads, model.n_layers, topo), "token": token,
              "position": PositionEmbedding("embedding.position", model.seq_len, C),
              "head": LanguageModelHead(token, C, topo)}
    return {piece: tuple((tuple(p.local_shape), bool(p.decay) and len(p.local_shape) >= 2) for p in layer.parameters())
            for piece, layer in layers.items()}
