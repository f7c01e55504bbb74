"""Pipeline schedules as data: for each stage, the list of operations it runs.

An operation is (action, micro-batch, chunk). The actions:

  F   the forward of one micro-batch through one chunk of this stage's layers
  BW  its whole backward, each layer's two halves in turn (GPipe, 1F1B, interleaved)
  B   only the input half, dL/dx: on the critical path, the previous stage waits for it
  W   only the weight half, dL/dW: nobody waits for it (Qi et al. 2024, §2)

A rank holds v chunks ("virtual stages", Narayanan et al. 2021, §2.2.2): chunk c of
pp rank r is virtual stage c*p + r of a pipeline of p*v, so a micro-batch visits
every rank v times. Without interleaving v = 1 and every chunk is 0. The V-shaped
schedules place rank r's two chunks at virtual stages r and 2p-1-r instead
(pipeline_parallel/placement.py holds both placements).

  GPipe (Huang et al. 2019): all m forwards, then all m backwards.
  1F1B (PipeDream-Flush, Narayanan et al. 2021, Fig. 4): three phases. Warm-up:
      stage r runs p-r-1 forwards, enough to fill the pipeline below it. Steady
      state: one forward, one backward, until every forward has run. Cool-down: the
      backwards still owed.
  Interleaved 1F1B (Narayanan et al. 2021, Fig. 4 bottom): the same three phases
      over the v*m (micro-batch, chunk) pairs, taken p micro-batches at a time per
      chunk, with (v-1)*p more warm-up forwards. Needs m to be a multiple of p
      (Megatron's rule).
  ZB-H1 (Qi et al. 2024, §2.1, Fig. 3 top): 1F1B with the backward split; stage r
      runs its first W r rounds late, so every stage keeps p micro-batches in flight
      and the W passes fill the bubble 1F1B leaves at the end of the iteration.
  ZB-V and DualPipeV (`zb_v`, `dualpipe_v` below): two chunks per rank in a V.

pipeline_parallel/timeline.py runs these lists in time (`simulate`): it proves a schedule
complete and deadlock-free and gives its ideal bubble.
"""

from typing import NamedTuple

from numpitron.pipeline_parallel.placement import StagePlacement

# The pipeline schedules' names, the one place they are spelled (the functions below
# build each; a schedule with separate weight passes splits every layer's backward).
GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE = "gpipe", "1f1b", "interleaved", "zero-bubble"
ZB_V, DUALPIPE_V = "zb-v", "dualpipev"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, ZB_V, DUALPIPE_V)
SPLIT_BACKWARD = (ZERO_BUBBLE, ZB_V, DUALPIPE_V)
# Two chunks per rank placed in a V (pipeline_parallel/placement.py): the first and the last
# virtual stage on pp rank 0.
V_SHAPED = (ZB_V, DUALPIPE_V)

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "BW", "B", "W"


class Op(NamedTuple):
    action: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.action}{self.microbatch}" + (f":{self.chunk}" if self.chunk else "")


def gpipe(m: int, p: int, stage: int, v: int = 1) -> list[Op]:
    return [Op(FORWARD, i) for i in range(m)] + [Op(BACKWARD, i) for i in range(m)]


def one_f_one_b(m: int, p: int, stage: int, v: int = 1) -> list[Op]:
    """Stage `stage` of p: p-stage-1 warm-up forwards (the last stage none), then one
    forward and one backward at a time, then the backwards still owed."""
    warmup = min(p - stage - 1, m)
    ops = [Op(FORWARD, i) for i in range(warmup)]                    # warm-up
    for i in range(m - warmup):                                      # steady state
        ops += [Op(FORWARD, warmup + i), Op(BACKWARD, i)]
    return ops + [Op(BACKWARD, i) for i in range(m - warmup, m)]     # cool-down


def interleaved(m: int, p: int, stage: int, v: int = 1) -> list[Op]:
    """1F1B's three phases over this rank's v*m (micro-batch, chunk) pairs. Forwards go
    p micro-batches through chunk 0, the same p through chunk 1, ..., then the next p;
    backwards in the same order with the chunks reversed. The warm-up is 1F1B's plus
    (v-1)*p: a whole round of the other chunks. With v = 1 this is 1F1B exactly."""
    def pair(k: int, backward: bool) -> tuple[int, int]:
        """The k-th forward (backward) of this rank: (micro-batch, chunk)."""
        group, within = divmod(k, p * v)        # which p micro-batches; where in their p*v operations
        chunk = within // p
        return group * p + within % p, (v - 1 - chunk if backward else chunk)

    total = m * v
    warmup = min((p - stage - 1) + (v - 1) * p, total)
    ops = [Op(FORWARD, *pair(k, False)) for k in range(warmup)]                       # warm-up
    for k in range(total - warmup):                                                   # steady state
        ops += [Op(FORWARD, *pair(warmup + k, False)), Op(BACKWARD, *pair(k, True))]
    return ops + [Op(BACKWARD, *pair(k, True)) for k in range(total - warmup, total)]   # cool-down


def zero_bubble(m: int, p: int, stage: int, v: int = 1) -> list[Op]:
    """ZB-H1. In round i of the steady state: F(warm-up + i), B(i), and W(i - stage);
    the W passes still owed are spent after each cool-down B and at the end."""
    warmup = min(p - stage - 1, m)
    ops, weights_done = [Op(FORWARD, i) for i in range(warmup)], 0
    for i in range(m - warmup):
        ops += [Op(FORWARD, warmup + i), Op(INPUT_GRAD, i)]
        if i >= stage:                       # later stages start their W later
            ops.append(Op(WEIGHT_GRAD, weights_done))
            weights_done += 1
    for i in range(m - warmup, m):
        ops.append(Op(INPUT_GRAD, i))
        ops.append(Op(WEIGHT_GRAD, weights_done))
        weights_done += 1
    return ops + [Op(WEIGHT_GRAD, i) for i in range(weights_done, m)]


class _VRank:
    """One rank's list for a V schedule, written phase by phase: each chunk's forwards
    and backwards go through the micro-batches in order, and a W is always the oldest
    weight half still owed (a backward run as B now owes its W)."""

    def __init__(self):
        self.ops, self.owed = [], []
        self.next = {(FORWARD, 0): 0, (FORWARD, 1): 0, (INPUT_GRAD, 0): 0, (INPUT_GRAD, 1): 0}

    def forward(self, chunk: int) -> None:
        self.ops.append(Op(FORWARD, self.next[FORWARD, chunk], chunk))
        self.next[FORWARD, chunk] += 1

    def backward(self, chunk: int, split: bool = True) -> None:
        """B (its W owed) when split, else the whole backward BW."""
        op = Op(INPUT_GRAD if split else BACKWARD, self.next[INPUT_GRAD, chunk], chunk)
        self.ops.append(op)
        self.next[INPUT_GRAD, chunk] += 1
        if split:
            self.owed.append(op._replace(action=WEIGHT_GRAD))

    def weight(self) -> None:
        self.ops.append(self.owed.pop(0))


def _v_warmup(rank: _VRank, p: int, r: int) -> None:
    """The start both V schedules share (rank r of p). The first chunk's forwards fill
    the V down to rank p-1: 2(p-r-1) of them alone, then r+1 pairs of a chunk-0 and a
    chunk-1 forward; then p-r-1 rounds of B1 W1 F1 while chunk 1's forwards arrive
    from below. Rank 0 has then run 2p-1 chunk-0 forwards: m >= 2p-1."""
    for _ in range(2 * (p - r - 1)):
        rank.forward(0)
    for _ in range(r + 1):
        rank.forward(0)
        rank.forward(1)
    for _ in range(p - r - 1):
        rank.backward(1)
        rank.weight()
        rank.forward(1)


def _v_drain(rank: _VRank, p: int, r: int) -> None:
    """The end both V schedules share: the last p-r-1 chunk-0 gradients come up from
    below, each B0 after one W owed; then the W passes still owed."""
    for _ in range(p - r - 1):
        rank.weight()
        rank.backward(0)
    while rank.owed:
        rank.weight()


def zb_v(m: int, p: int, stage: int, v: int = 2) -> list[Op]:
    """ZB-V (Qi et al. 2024, the V schedule of zero bubble): every backward split. In
    the steady state each round frees before it allocates, B1 W1 B0 W0 F0 F1, so no
    rank ever holds more than 2p chunk caches: p micro-batches' worth, 1F1B's first
    stage. In the cool-down the W passes wait while the B passes, which the ranks
    below wait for, go first; the W passes fill the time that would be idle."""
    rank, r = _VRank(), stage
    _v_warmup(rank, p, r)
    for _ in range(m - 2 * p + r + 1):                  # steady state
        for chunk in (1, 0):
            rank.backward(chunk)
            rank.weight()
        rank.forward(0)
        rank.forward(1)
    for _ in range(p - r - 1):                          # chunk 0's forwards are done
        for chunk in (1, 0):
            rank.backward(chunk)
            rank.weight()
        rank.forward(1)
    for _ in range(r + 1):                              # cool-down: B first, W later
        rank.backward(1)
        rank.backward(0)
    _v_drain(rank, p, r)
    return rank.ops


def dualpipe_v(m: int, p: int, stage: int, v: int = 2) -> list[Op]:
    """DualPipeV (DeepSeek-AI 2025, DualPipe cut in half, after the deepseek-ai/DualPipe
    README): in the steady state a forward of one chunk is paired with the whole
    backward of the other, F0 BW1, F1 BW0, so that on a GPU one's computation hides the
    other's communication. Here the pair is two operations in a row (the compute never
    runs concurrently on a CPU). The backward is split only near the ends, where its
    W passes fill the ramps. Each rank holds up to 2p + 1 chunk caches."""
    rank, r = _VRank(), stage
    _v_warmup(rank, p, r)
    for _ in range(m - 2 * p + r + 1):                  # steady state: overlapped pairs
        rank.forward(0)
        rank.backward(1, split=False)
        rank.forward(1)
        rank.backward(0, split=False)
    for _ in range(p - r - 1):                          # chunk 0's forwards are done
        rank.backward(1, split=False)
        rank.forward(1)
        rank.backward(0, split=False)
    # Cool-down: r+1 rounds of B1 B0, whole at first, split from the middle on (chunk
    # 1 switches first on odd ranks).
    middle = (r + 1) // 2
    for i in range(r + 1):
        rank.backward(1, split=i > middle or (i == middle and r % 2 == 1))
        rank.backward(0, split=i >= middle)
    _v_drain(rank, p, r)
    return rank.ops


BUILDERS = {GPIPE: gpipe, ONE_F_ONE_B: one_f_one_b, INTERLEAVED: interleaved, ZERO_BUBBLE: zero_bubble,
            ZB_V: zb_v, DUALPIPE_V: dualpipe_v}


def make_schedule(name: str, m: int, p: int, stage: int, v: int = 1) -> list[Op]:
    return BUILDERS[name](m, p, stage, v)


def placement_of(name: str, p: int, v: int = 1) -> StagePlacement:
    """Where a schedule's virtual stages live: the V schedules' own placement, else the loop."""
    return StagePlacement(p, 2, True) if name in V_SHAPED else StagePlacement(p, v)


def format_schedule(ops: list[Op]) -> str:
    """'F0 F1 B0 F2 ...', chunk after a colon when it is not 0."""
    return " ".join(str(op) for op in ops)


def closed_form_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of an iteration from the papers, with a backward twice a forward
    and the halves equal: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved
    (Narayanan et al. 2021, §2.2.2), (p-1)/(3m+p-1) for ZB-H1 (Qi et al. 2024, §2.1:
    a bubble of (p-1)(T_F + T_B - T_W) against 1F1B's (p-1)(T_F + T_B + T_W)).
    Exact for ZB-H1 when m >= p, and for interleaving when p divides m.
    ZB-V and DualPipeV, each chunk half a stage: every rank idles (p-1) chunk
    forwards, (p-1)/2 of 1F1B's units, so (p-1)/(6m+p-1) (docs/11-pipeline-schedules.md
    derives it and sets it beside the DualPipe README's table)."""
    if name in V_SHAPED:
        return (p - 1) / (6 * m + p - 1)
    if name == INTERLEAVED:
        return (p - 1) / (v * m + p - 1)
    if name == ZERO_BUBBLE:
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)
