"""Which way of training across a slow link is fastest at which link rate, priced
before any run (docs/18-across-slow-links.md, "Where each method wins").

A method's iteration costs its compute t_c (the same for all: the tokens are the same),
its own work t_own (compression's encode and decode, DiLoCo's outer step), and its
traffic: α per message that crosses hosts, the bytes its busiest rank sends across
over that rank's card of β bytes/s, and the bytes it sends inside its host first or
after (not beside) over β_in:

    t(β) = t_c + t_own + n α + x / β + y / β_in        (+ what streaming leaves exposed)

A method wins where its t(β) is below plain dp's. Both fall as β grows and their
difference changes sign at one rate β* at most; a method that sends less across wins
below it:

    β* = (x_dp - x) / (t_own + (n - n_dp) α + (y - y_dp) / β_in)      (no overlap)

`crossing` turns the bytes a run counts per rank (CommStats' ring formula, what
metrics.jsonl and the planner report) into x, y and what host 0's link carries, for
MPICH's algorithms on hosts of `per_host` ranks: an all-reduce above 2 KiB halves
recursively, pairing a host's own ranks first, so each rank then sends 1/q of the
buffer's 2 (h - 1)/h across (chapter 17's hierarchical all-reduce; the link counters of
chapter 9 show it); an all-gather above 512 KiB runs a ring, in which the one rank
before each host boundary sends all g - 1 blocks across, beside the ring's other hops.

A card gives each direction its β only while the other is idle. Both of the halving's
steps across, and a ring of one rank a host, send and receive at once, and TCP's
acknowledgements then queue behind the other direction's data in the shaped card: such
bytes cost x / (e β), e < 1 the card's measured two-way efficiency, which depends on the
rate and on the message (`TwoWay`, probed by benchmarks/two_way_probe.py). With e varying
with β the two times may meet more than once, so `crossings` scans the rates.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """One way to train, per iteration: bytes the busiest rank sends across hosts
    (`crossing`) and inside its host in series with them (`inside`), crossing
    messages, its own seconds of work, streaming DiLoCo's (F, H, τ), and the part of
    `crossing` sent while as much is received, as ((bytes, one message's bytes), ...)."""
    name: str
    crossing: float
    inside: float = 0.0
    messages: float = 0.0
    own_s: float = 0.0
    streaming: tuple = (1, 1, 0)
    both_ways: tuple = ()


class TwoWay:
    """e(β, message): the share of β each direction of a card gets when it sends and
    receives at once, from probes {β: {message bytes: e}}; between the probed rates and
    messages it is interpolated on their logarithms, beyond them held at the nearest."""

    def __init__(self, probes: dict):
        self.probes = {float(b): {float(m): e for m, e in row.items()} for b, row in probes.items()}

    @staticmethod
    def _between(points: dict, x: float, value) -> float:
        keys = sorted(points)
        if x <= keys[0] or x >= keys[-1]:
            return value(points[keys[0] if x <= keys[0] else keys[-1]])
        hi = next(k for k in keys if k >= x)
        lo = keys[keys.index(hi) - 1]
        w = math.log(x / lo) / math.log(hi / lo)
        return (1 - w) * value(points[lo]) + w * value(points[hi])

    def __call__(self, beta: float, message: float) -> float:
        return self._between(self.probes, beta, lambda row: self._between(row, message, lambda e: e))


def crossing(kind: str, counted: float, ranks: int, hosts: int, per_host: int) -> dict:
    """{"crossing", "inside": bytes the busiest rank sends, "link": bytes host 0's link
    carries both ways, "both_ways": the part of "crossing" its card sends while receiving
    as much, "message": the largest message across} for one collective kind ("group.op")
    over `ranks` ranks spread evenly over `hosts` hosts of `per_host` ranks, `counted` the ring formula's bytes per
    rank (2 (g-1)/g of the buffer for an all-reduce, (g-1) blocks for an all-gather)."""
    op, q = kind.split(".")[-1], ranks // hosts          # q: the group's ranks on one host
    groups = per_host // q                               # groups with ranks on host 0
    if op == "all_gather":
        block = counted / (ranks - 1)
        across = (ranks - 1) * block if hosts > 1 else 0.0      # the ring's edge out of a host
        return {"crossing": across, "inside": 0.0, "link": 2 * groups * across,      # out of host 0 and into it
                "both_ways": across if q == 1 else 0.0, "message": block}   # one rank a host: it sends and receives
    buffer = counted * ranks / (2 * (ranks - 1))
    across = 2 * (hosts - 1) / hosts * buffer / q                    # each rank's 1/q, over the hosts
    inside = 2 * (q - 1) / q * buffer                                # the host's own pairs, before and after
    return {"crossing": across, "inside": inside, "link": 2 * per_host * across,
            "both_ways": across, "message": buffer / (2 * q)}        # a step across swaps half of the rank's 1/q


def method(name: str, counted: dict, calls: dict, groups: dict, per_host: int, own_s: float = 0.0,
           streaming: tuple = (1, 1, 0)) -> tuple[Method, float]:
    """(the Method, bytes host 0's link carries both ways per iteration) from a run's or
    the planner's bytes and calls per iteration by kind; `groups` maps a group to
    (ranks, hosts) and leaves out those of one rank."""
    x = y = n = link = 0.0
    both = []
    for kind, nbytes in counted.items():
        ranks, hosts = groups.get(kind.split(".")[0], (1, 1))
        if ranks == 1:
            continue
        part = crossing(kind, nbytes, ranks, hosts, per_host)
        x, y, link = x + part["crossing"], y + part["inside"], link + part["link"]
        if part["both_ways"]:      # one call's message: a kind called once a round (DiLoCo's) sends it all at
            # once; one called each iteration carries its bytes in one large call (the gradients beside a scalar)
            both.append((part["both_ways"], part["message"] / min(1, calls.get(kind, 1))))
        if hosts > 1:         # a recursive halving's messages across: 2 log2 h; a ring's g - 1
            ring = kind.endswith("all_gather")
            n += calls.get(kind, 0) * ((ranks - 1) if ring else 2 * math.ceil(math.log2(hosts)))
    return Method(name, x, y, n, own_s, streaming, tuple(both)), link


def seconds_per_iteration(m: Method, compute_s: float, alpha: float, beta: float, beta_inside: float,
                          two_way=None) -> float:
    """t(β) of the module's docstring, the both-way bytes at e β when `two_way` (a TwoWay)
    is given. Streaming DiLoCo sends its F fragments one by one, each beside the τ steps
    after it (plan/slow_links.py's hidden_outer_seconds): of a fragment's α + x H / F / β,
    what τ steps of compute do not cover is exposed."""
    F, H, tau = m.streaming
    step = compute_s + m.own_s + m.inside / beta_inside
    slower = sum(b * (1 / two_way(beta, msg) - 1) for b, msg in m.both_ways) if two_way else 0.0
    link = m.messages * alpha + (m.crossing + slower) / beta
    if tau:
        link = F / H * max(0.0, link * H / F - tau * step)
    return step + link


def crossings(m: Method, dp: Method, compute_s: float, alpha: float, beta_inside: float, two_way=None,
              low: float = 1.0, high: float = 1e13, points: int = 400) -> list:
    """The rates β (bytes/s a rank's card) where m's iteration and plain dp's take equally
    long, lowest first: none when one of them is shorter at every rate from `low` to
    `high` (`wins` says which). With a constant e each difference of the two times is
    monotonic in 1/β and they meet once at most; a measured e(β) may bend it, so the
    rates are scanned on a log grid and each change of winner bisected."""
    def m_wins(beta):
        return wins(m, dp, beta, compute_s, alpha, beta_inside, two_way)
    grid = [low * (high / low) ** (i / points) for i in range(points + 1)]
    won = [m_wins(beta) for beta in grid]                     # each rate priced once
    found = []
    for a, b, below, above in zip(grid, grid[1:], won, won[1:]):
        if below != above:
            for _ in range(100):
                mid = math.sqrt(a * b)
                a, b = (mid, b) if m_wins(mid) == below else (a, mid)
            found.append(math.sqrt(a * b))
    return found


def wins(m: Method, dp: Method, beta: float, compute_s: float, alpha: float, beta_inside: float,
         two_way=None) -> bool:
    """Is m's iteration shorter than plain dp's on cards of β bytes/s?"""
    return seconds_per_iteration(m, compute_s, alpha, beta, beta_inside, two_way) < \
        seconds_per_iteration(dp, compute_s, alpha, beta, beta_inside, two_way)
