"""Parameters of each piece of the model on one tp rank, counted from the layers' own
Params (built without communicators, never allocated): a block, the token and position
embeddings, the head's final LayerNorm and, with experts, an MoE block's dense part and
one routed expert (plan/experts.py); and where Muon's matrices lie in each."""

import math
from functools import cache

from numpitron.distributed.topology import Topology
from numpitron.transformer.block import Block
from numpitron.nn.embedding import PositionEmbedding
from numpitron.tensor_parallel.vocab_parallel import VocabParallelEmbedding
from numpitron.transformer.head import LanguageModelHead
from numpitron.muon.muon import is_hidden_matrix, matrix_shape
from numpitron.plan.experts import moe_layer_params, moe_layer_sizes


@cache
def layer_parameter_sizes(model, tp: int) -> dict:
    """{piece: ((elements, tp-replicated?) of each Param on one tp rank, in order)} for a
    block, the token embedding, the position embedding and the head (its ln_f), from the
    layers' own Params: built as tp rank 0 of a mesh without communicators (every tp
    rank holds as many), never allocated."""
    topo, C = Topology(None, tp, 1, 1), model.d_model
    token = VocabParallelEmbedding("embedding.token", model.vocab_size, C, topo)
    pieces = {"block": Block("blocks.0", C, model.n_heads, model.n_layers, topo), "token": token,
              "position": PositionEmbedding("embedding.position", model.seq_len, C),
              "head": LanguageModelHead(token, C, topo)}
    sizes = {piece: tuple((math.prod(p.local_shape), p.split_axis is None) for p in layer.parameters())
             for piece, layer in pieces.items()}
    return {**sizes, **(moe_layer_sizes(model, tp) if model.num_experts else {})}


def layer_elements(model, tp: int) -> dict:
    """{piece: (elements on one tp rank, of which tp-replicated)} of each piece above."""
    return {piece: (sum(n for n, _ in sizes), sum(n for n, replicated in sizes if replicated))
            for piece, sizes in layer_parameter_sizes(model, tp).items()}


def block_piece(model, index: int) -> str:
    """The dense buffer's piece of block `index`: a dense block, or an MoE block's
    attention, router and shared experts (its routed experts are in the expert buffer)."""
    return "moe_block" if model.is_moe_block(index) else "block"


@cache
def matrix_spans(model, tp: int) -> dict:
    """{piece: (its elements on one tp rank, the [start, stop) within it of each matrix
    Muon updates (muon/muon.py: `is_hidden_matrix`), in the order of the flat buffer)}
    for a block and, with experts, an MoE block's dense part and one expert; each span
    with the matrix's whole (A, B) shape."""
    pieces = {"block": Block("blocks.0", model.d_model, model.n_heads, model.n_layers, Topology(None, tp, 1, 1)).parameters(),
              **(moe_layer_params(model, tp) if model.num_experts else {})}
    out = {}
    for piece, params in pieces.items():
        spans, offset = [], 0
        for p in params:
            n = math.prod(p.local_shape)
            if is_hidden_matrix(p):
                spans.append((offset, offset + n, matrix_shape(p)))
            offset += n
        out[piece] = (offset, tuple(spans))
    return out


def stage_matrices(model, rank, experts: bool = False) -> list[tuple[int, int, tuple]]:
    """Muon's matrices in a rank's flat buffer (plan/accounting.py's `Rank`), as (start,
    stop, whole shape): the dense buffer is the token embedding (first and last stage),
    the positions (first), then the blocks, then ln_f (last); the expert buffer holds
    E/ep experts of each MoE block."""
    layers, spans, blocks = layer_elements(model, rank.tp), matrix_spans(model, rank.tp), rank.blocks(model.n_layers)
    if experts:
        start, pieces = 0, ["expert"] * (sum(map(model.is_moe_block, blocks)) * model.num_experts // rank.ep)
    else:
        start = layers["token"][0] * (rank.first or rank.last) + layers["position"][0] * rank.first
        pieces = [block_piece(model, b) for b in blocks]
    out = []
    for piece in pieces:
        size, matrices = spans[piece]
        out += [(start + a, start + z, shape) for a, z, shape in matrices]
        start += size
    return out


def muon_elements(model, rank, lo: int, hi: int, experts: bool = False) -> int:
    """Elements of Muon's matrices inside [lo, hi) of a rank's dense or expert buffer."""
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b, _ in stage_matrices(model, rank, experts))
