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
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """One way to train, per iteration: bytes the busiest rank sends across hosts
    (`crossing`) and inside its host in series with them (`inside`), crossing
    messages, its own seconds of work, and streaming DiLoCo's (F, H, τ)."""
    name: str
    crossing: float
    inside: float = 0.0
    messages: float = 0.0
    own_s: float = 0.0
    streaming: tuple = (1, 1, 0)


def crossing(kind: str, counted: float, ranks: int, hosts: int, per_host: int) -> dict:
    """{"crossing", "inside": bytes the busiest rank sends, "link": bytes host 0's link
    carries both ways} for one collective kind ("group.op") over `ranks` ranks spread
    evenly over `hosts` hosts of `per_host` ranks, `counted` the ring formula's bytes per
    rank (2 (g-1)/g of the buffer for an all-reduce, (g-1) blocks for an all-gather)."""
    op, q = kind.split(".")[-1], ranks // hosts          # q: the group's ranks on one host
    groups = per_host // q                               # groups with ranks on host 0
    if op == "all_gather":
        block = counted / (ranks - 1)
        across = (ranks - 1) * block if hosts > 1 else 0.0      # the ring's edge out of a host
        return {"crossing": across, "inside": 0.0, "link": 2 * groups * across}       # out of host 0 and into it
    buffer = counted * ranks / (2 * (ranks - 1))
    across = 2 * (hosts - 1) / hosts * buffer / q                    # each rank's 1/q, over the hosts
    inside = 2 * (q - 1) / q * buffer                                # the host's own pairs, before and after
    return {"crossing": across, "inside": inside, "link": 2 * per_host * across}


def method(name: str, counted: dict, calls: dict, groups: dict, per_host: int, own_s: float = 0.0,
           streaming: tuple = (1, 1, 0)) -> tuple[Method, float]:
    """(the Method, bytes host 0's link carries both ways per iteration) from a run's or
    the planner's bytes and calls per iteration by kind; `groups` maps a group to
    (ranks, hosts) and leaves out those of one rank."""
    x = y = n = link = 0.0
    for kind, nbytes in counted.items():
        ranks, hosts = groups.get(kind.split(".")[0], (1, 1))
        if ranks == 1:
            continue
        part = crossing(kind, nbytes, ranks, hosts, per_host)
        x, y, link = x + part["crossing"], y + part["inside"], link + part["link"]
        if hosts > 1:         # a recursive halving's messages across: 2 log2 h; a ring's g - 1
            ring = kind.endswith("all_gather")
            n += calls.get(kind, 0) * ((ranks - 1) if ring else 2 * math.ceil(math.log2(hosts)))
    return Method(name, x, y, n, own_s, streaming), link


def seconds_per_iteration(m: Method, compute_s: float, alpha: float, beta: float, beta_inside: float) -> float:
    """t(β) of the module's docstring. Streaming DiLoCo sends its F fragments one by one,
    each beside the τ steps after it (plan/slow_links.py's hidden_outer_seconds): of a
    fragment's α + x H / F / β, what τ steps of compute do not cover is exposed."""
    F, H, tau = m.streaming
    step = compute_s + m.own_s + m.inside / beta_inside
    link = m.messages * alpha + m.crossing / beta
    if tau:
        link = F / H * max(0.0, link * H / F - tau * step)
    return step + link


def crossover(m: Method, dp: Method, compute_s: float, alpha: float, beta_inside: float,
              low: float = 1.0, high: float = 1e13) -> float | None:
    """β* (bytes/s a rank's card) where m's iteration and plain dp's take equally long:
    math.inf when m is shorter at every rate from `low` to `high`, None when at none.
    Usually m sends less across and wins below β*; a method that sends more across but
    less inside its host (int8's ring: nothing in series inside) wins above it instead
    (`wins(m, dp, low, ...)` says which). Each difference of the two times is monotonic
    in 1/β, so it changes sign once at most: bisection on log β finds it."""
    below = wins(m, dp, low, compute_s, alpha, beta_inside)
    if below == wins(m, dp, high, compute_s, alpha, beta_inside):
        return math.inf if below else None
    for _ in range(200):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if wins(m, dp, mid, compute_s, alpha, beta_inside) == below else (low, mid)
    return math.sqrt(low * high)


def wins(m: Method, dp: Method, beta: float, compute_s: float, alpha: float, beta_inside: float) -> bool:
    """Is m's iteration shorter than plain dp's on cards of β bytes/s?"""
    return seconds_per_iteration(m, compute_s, alpha, beta, beta_inside) < \
        seconds_per_iteration(dp, compute_s, alpha, beta, beta_inside)
