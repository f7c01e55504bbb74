"""One pair of a forward chunk and a backward chunk, measured: when each computes and
when each one's expert all-to-alls are in flight, run in turn and run as a pair
(chunk_pairing/, DeepSeek-V3 §3.2.1, Figure 4). Chapters 9 and 11 show it.

    mpiexec -n 2 python benchmarks/chunk_pair_timeline.py --out docs/figures/chunk_pair.svg

Two ranks are one ep group (dp = ep = 2); the stage holds every block, each a mixture of
experts with a shared expert. The backward is micro-batch 0's, the forward micro-batch
1's: in turn (F then BW, each all-to-all waited for where it starts, after the shared
experts' filler) and as a pair (each hands over at its waits). Rank 0 records, on its
own clock: a chunk "computes" while it holds the turn and is not inside a wait; an
all-to-all is "in flight" from its start until the wait that finishes it returns (or
a test finds it done). The figure is rank 0's; both ranks run alike.
"""

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

import numpy as np  # noqa: E402

from numpitron.build import build_stage  # noqa: E402
from numpitron.chunk_pairing.pair import ChunkPair  # noqa: E402
from numpitron.config import ModelConfig  # noqa: E402
from numpitron.distributed.topology import Topology  # noqa: E402

COLORS = {"F": "#4c78a8", "BW": "#f58518"}


class Recorder:
    """Compute segments and all-to-alls in flight per chunk, from instance-level wrappers."""

    def __init__(self, topo, pair: ChunkPair):
        self.t0, self.label = time.perf_counter(), {}
        self.waits, self.flights, self.turns = [], [], []
        comm = topo.ep_comm
        start, wait, test = comm.iall_to_allv, comm.wait, comm.test
        give = pair._give_turn

        def now():
            return time.perf_counter() - self.t0

        def started(*args):
            recv, pending = start(*args)
            pending.flight = [self.chunk(), now(), None]
            self.flights.append(pending.flight)
            return recv, pending

        def waited(pending):
            begin = now()
            wait(pending)
            if getattr(pending, "flight", None) and pending.flight[2] is None:
                pending.flight[2] = now()
            self.waits.append((self.chunk(), begin, now()))

        def tested(pending):
            test(pending)
            for p in pending:
                if p.done and getattr(p, "flight", None) and p.flight[2] is None:
                    p.flight[2] = now()

        def given(me, to):
            self.turns.append((self.chunk(), "give", now()))
            give(me, to)
            if pair.alive[me]:
                self.turns.append((self.chunk(), "take", now()))
        comm.iall_to_allv, comm.wait, comm.test, pair._give_turn = started, waited, tested, given
        self.now = now
        self.undo = lambda: [delattr(comm, name) for name in ("iall_to_allv", "wait", "test")]

    def chunk(self) -> str:
        return self.label.get(threading.get_ident(), "?")

    def labelled(self, name: str, work):
        def run():
            self.label[threading.get_ident()] = name
            self.turns.append((name, "take", self.now()))
            out = work()
            self.turns.append((name, "give", self.now()))
            return out
        return run

    def segments(self) -> dict:
        """{chunk: [(start, end) computing]}: turn-held intervals less the waits inside them."""
        held = {}
        open_at = {}
        for name, kind, t in self.turns:
            if kind == "take":
                open_at[name] = t
            elif name in open_at:
                held.setdefault(name, []).append((open_at.pop(name), t))
        out = {}
        for name, spans in held.items():
            for a, b in spans:
                cuts = sorted((s, e) for n, s, e in self.waits if n == name and a <= s < b)
                for s, e in cuts:
                    out.setdefault(name, []).append((a, s))
                    a = e
                out.setdefault(name, []).append((a, b))
        return out


def one_pair(stage, topo, x, targets, paired: bool) -> dict:
    """micro-batch 0's forward (kept), then its backward with micro-batch 1's forward."""
    _, cache0 = stage.forward(x[0], targets[0])
    pair = ChunkPair()
    for layer in stage.experts.layers:
        layer.dispatcher.meanwhile = pair.meanwhile if paired else (lambda comm, pending: None)
    rec = Recorder(topo, pair)
    forward = rec.labelled("F", lambda: stage.forward(x[1], targets[1]))
    backward = rec.labelled("BW", lambda: stage.backward(1.0, cache0))
    topo.world.barrier()
    start = rec.now()
    if paired:
        pair.run(forward, backward)
    else:
        forward()
        backward()
    end = rec.now()
    rec.undo()
    return {"wall_s": end - start, "compute": {k: [(a - start, b - start) for a, b in v] for k, v in rec.segments().items()},
            "in_flight": [(name, a - start, (b or end) - start) for name, a, b in rec.flights]}


def draw(results: dict, out: Path, note: str) -> None:
    import matplotlib
    matplotlib.use("svg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 3.2), sharex=True)
    for ax, (mode, r) in zip(axes, results.items()):
        rows = {"F computes": 3, "BW computes": 2, "F all-to-all in flight": 1, "BW all-to-all in flight": 0}
        for name, spans in r["compute"].items():
            ax.broken_barh([(a, b - a) for a, b in spans], (rows[f"{name} computes"] - 0.35, 0.7),
                           color=COLORS[name])
        for name, a, b in r["in_flight"]:
            ax.broken_barh([(a, b - a)], (rows[f"{name} all-to-all in flight"] - 0.3, 0.6), color=COLORS[name],
                           alpha=0.45, edgecolor="black", linewidth=0.3)
        ax.set_yticks(list(rows.values()), list(rows.keys()), fontsize=7)
        ax.set_title(f"{mode}: {1e3 * r['wall_s']:.1f} ms", fontsize=8, loc="left")
    axes[1].set_xlabel("seconds from the pair's start (rank 0)", fontsize=7)
    fig.text(0.01, -0.07, note, fontsize=5.5, color="#555555")
    fig.savefig(out, bbox_inches="tight")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/figures/chunk_pair.svg")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="the fastest of this many of each")
    args = p.parse_args()
    topo = Topology.from_world(data=2, expert=2)
    cfg = ModelConfig(vocab_size=65, seq_len=64, n_layers=2, n_heads=4, d_model=args.d_model, dtype="float32",
                      num_experts=4, moe_top_k=2, moe_shared_experts=1).validate()
    stage = build_stage(cfg, topo, seed=1)
    rng = np.random.default_rng(topo.rank)
    x = rng.integers(0, 65, (2, args.batch, 64))
    results = {}
    for mode, paired in (("in turn", False), ("as a pair", True)):
        runs = [one_pair(stage, topo, x, x, paired) for _ in range(args.repeats)]
        results[mode] = min(runs, key=lambda r: r["wall_s"])
    if topo.rank == 0:
        note = (f"mpiexec -n 2 python benchmarks/chunk_pair_timeline.py: dp = ep = 2, {cfg.n_layers} MoE blocks "
                f"(E = 4, top 2, 1 shared), C = {cfg.d_model}, B = {args.batch}, T = 64, float32; fastest of "
                f"{args.repeats}; one CPU node (the all-to-alls are copies, no link), busy")
        draw(results, Path(args.out), note)
        print(json.dumps({mode: round(r["wall_s"], 4) for mode, r in results.items()}))


if __name__ == "__main__":
    main()
