"""Bytes a rank stores and moves in one training iteration, computed from the configs
and the mesh alone: one function per quantity, each term named after the strategy
that adds it. Tests compare every figure with what a real run counts (`ParamStore`,
the optimizer, `CommStats`), to the byte; the activations are plan/activations.py's,
the bytes moved plan/traffic.py's.

A rank is described by its stage (pp_rank), the placement of the virtual stages on
the pipeline's ranks (the model's own `StagePlacement`: a loop, or a V whose rank 0
holds both the embeddings and the head) and its cp_rank; tp, dp ranks do not change
these figures.
"""

from dataclasses import dataclass

from numpitron.distributed.sharding import pad_to_multiple
from numpitron.pipeline_parallel.placement import StagePlacement
from numpitron.plan.experts import expert_elements
from numpitron.plan.layer_sizes import block_piece, layer_elements, muon_elements
from numpitron.precision.formats import FORMATS
from numpitron.pipeline_parallel.schedules import placement_of

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
    ep: int = 1                    # expert parallelism, carved out of dp x cp
    tp_rank: int = 0               # only Muon's owners depend on it (plan/muon_cost.py)

    @classmethod
    def of(cls, topo, parallel) -> "Rank":
        """This process's rank, its virtual stages placed as `parallel`'s schedule places them."""
        return cls(topo.tp, topo.pp, topo.dp, topo.cp, topo.pp_rank, topo.cp_rank, topo.dp_rank, topo.dp_shard,
                   placement_of(parallel.schedule, topo.pp, parallel.virtual_stages), topo.ep, topo.tp_rank)

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts, which average their gradients: dp x cp / ep."""
        return self.dp * self.cp // self.ep

    @property
    def expert_dp_rank(self) -> int:
        return (self.dp_rank * self.cp + self.cp_rank) // self.ep

    @property
    def expert_shard_group(self) -> int:
        """expert_dp ranks of one replica, which shard an expert's state (expert_dp_shard):
        cp x S / ep, all of expert_dp unless hybrid (distributed/topology.py)."""
        return max(self.shard_group // self.ep, 1)

    @property
    def expert_shard_rank(self) -> int:
        return self.expert_dp_rank % self.expert_shard_group

    def block_ranges(self, n_layers: int) -> list[tuple[int, int]]:
        """[first, last + 1) of the blocks of each chunk of this rank's stage, in the order
        of its flat buffer."""
        placed = self.stages
        return [(j * n_layers // placed.stages, (j + 1) * n_layers // placed.stages)
                for c in range(placed.v) for j in [placed.stage(self.stage, c)]]

    def blocks(self, n_layers: int) -> list[int]:
        """The blocks of this rank's stage, in the order of its flat buffer (chunk by chunk)."""
        return [i for lo, hi in self.block_ranges(n_layers) for i in range(lo, hi)]

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


def parameter_elements(model, rank: Rank) -> tuple[int, int]:
    """(elements of this rank's slice of its stage, of which tp-replicated): its blocks,
    the token embedding on the first and last stage (one copy each, one in all when
    one rank holds both, as rank 0 of a V), the positions on the first, ln_f on the last."""
    layers = layer_elements(model, rank.tp)
    copies = {"token": int(rank.first or rank.last), "position": int(rank.first), "head": int(rank.last)}
    copies.update(stage_block_counts(model, rank))
    return tuple(sum(count * layers[piece][i] for piece, count in copies.items() if count) for i in (0, 1))


def stage_block_counts(model, rank: Rank) -> dict:
    """{"block": dense blocks, "moe_block": MoE blocks} of this rank's stage, counted per
    chunk without listing them (a config read from a file may claim 10^9 layers): block
    i is an MoE block when i is a multiple of moe_every (config.py's is_moe_block)."""
    every, counts = (model.moe_every if model.num_experts else 0), {"block": 0, "moe_block": 0}
    for lo, hi in rank.block_ranges(model.n_layers):
        moe = (hi + every - 1) // every - (lo + every - 1) // every if every else 0
        counts["moe_block"] += moe
        counts["block"] += hi - lo - moe
    return counts


def block_elements(model, rank: Rank) -> list[int]:
    """Each block of this rank's stage in the dense buffer: the ZeRO-3 units."""
    layers = layer_elements(model, rank.tp)
    return [layers[block_piece(model, b)][0] for b in rank.blocks(model.n_layers)]


def optimizer_state_elements(model, rank: Rank, lo: int, hi: int, optimizer: str, experts: bool = False) -> int:
    """AdamW keeps two moments per element of [lo, hi); Muon one on its matrices; SGD none."""
    if optimizer == "sgd":
        return 0
    return 2 * (hi - lo) - (muon_elements(model, rank, lo, hi, experts) if optimizer == "muon" else 0)


def state_bytes(model, parallel, rank: Rank, optimizer: str = "adamw", precision: str = "fp32") -> dict:
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
    is the sum. Mixed precision (docs/07-numbers.md): parameters and gradients in the
    low format, 2 bytes; the optimizer state 12 bytes an element of its slice, the fp32
    master weights and both fp32 moments (Muon is fp32 only). Experts (docs/13-experts.md):
    a second buffer, E/ep experts of each MoE block, sharded the same way over the
    expert_dp ranks of one replica (cp x S / ep), at stage 2 under ZeRO-3 (build.py)."""
    fmt = FORMATS[precision]
    # state_item: bytes per moment element (optimizer_state_elements counts two an element):
    # mixed, (4 master + 4 m + 4 v) / 2.
    items = (fmt.itemsize, 6) if fmt.mixed else (model.itemsize, model.itemsize)
    size, counts, layers = parameter_elements(model, rank)[0], stage_block_counts(model, rank), layer_elements(model, rank.tp)
    in_blocks = sum(n * layers[piece][0] for piece, n in counts.items() if n)
    whole = min(2 if parallel.overlap_grad_reduce else 1, sum(counts.values()))   # no prefetch: one at a time
    if sum(counts.values()) <= 4096:    # the largest `whole` neighbours of the buffer
        blocks = block_elements(model, rank)
        gathered = max(sum(blocks[i:i + whole]) for i in range(len(blocks) - whole + 1)) if blocks else 0
    else:                               # too many to list: `whole` of the largest kind, at most that
        gathered = whole * max(layers[piece][0] for piece, n in counts.items() if n)
    dense = _buffer_state(size, rank.shard_group, rank.shard_rank, parallel.zero_stage, parallel.hierarchical_all_reduce,
                          items, lambda lo, hi: optimizer_state_elements(model, rank, lo, hi, optimizer),
                          in_pass=lambda padded: padded - in_blocks + gathered)
    if not model.num_experts:
        return dense
    experts = _buffer_state(expert_elements(model, rank.blocks(model.n_layers), rank.tp, rank.ep),
                            rank.expert_shard_group, rank.expert_shard_rank, min(parallel.zero_stage, 2), parallel.hierarchical_all_reduce, items,
                            lambda lo, hi: optimizer_state_elements(model, rank, lo, hi, optimizer, experts=True),
                            in_pass=None)
    return {key: dense[key] + experts[key] for key in dense}


def _buffer_state(size: int, group: int, group_rank: int, stage: int, hierarchical: bool, items, moments,
                  in_pass) -> dict:
    """One flat buffer's bytes on a rank (state_bytes): `size` elements sharded over
    `group` ranks at ZeRO `stage`; moments(lo, hi): the optimizer's state elements of
    [lo, hi); in_pass(padded): elements gathered whole during a pass (ZeRO-3)."""
    item, state_item = items
    if stage == 0:
        size = pad_to_multiple(size, group) if hierarchical else size
        return {"params": size * item, "grads": size * item, "optimizer_state": moments(0, size) * state_item,
                "gathered_params_peak": 0, "backward_grads_peak": 0}
    padded = pad_to_multiple(size, group)
    shard = padded // group
    peak = in_pass(padded) if stage == 3 else 0
    return {"params": (shard if stage == 3 else padded) * item,
            "grads": (shard + (padded if stage == 1 else 0)) * item,
            "optimizer_state": moments(group_rank * shard, (group_rank + 1) * shard) * state_item,
            "gathered_params_peak": peak * item,
            "backward_grads_peak": {1: 0, 2: padded, 3: peak}[stage] * item}
