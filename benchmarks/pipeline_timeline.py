"""Draw one real pipeline iteration per stage for each schedule (GPipe, 1F1B,
interleaved 1F1B with 2 virtual stages, zero-bubble ZB-H1, ZB-V, DualPipeV), as an SVG.

    mpiexec -n 2 python benchmarks/pipeline_timeline.py --out docs/pipeline_timeline.svg
    python benchmarks/pipeline_timeline.py --ideal 4 --out docs/pipeline_ideal.svg
    python benchmarks/pipeline_timeline.py --redraw docs/figures/pipeline_timeline.json

A measured run also writes its events beside the figure (docs/figures/pipeline_timeline.json),
so --redraw draws the chart again from them without running anything.

With --ideal p, no process runs: the schedules' unit-cost timelines on p stages come
from the simulator (pipeline_parallel/schedules.py, simulate), a forward, an input half and a
weight half of a whole stage each costing 1 (a chunk of a V half of that).

Every stage records when each operation of each micro-batch started and ended
(PipelineStats.events); rank 0 gathers them and draws a row per stage: the gaps are
the pipeline bubble. Each panel states the measured bubble beside the schedule's
formula (pipeline_parallel/schedules.py, closed_form_bubble) and the peak (micro-batch,
chunk) pairs held at once per stage. The model has 2p layers, so that interleaving
gives every chunk one block.
"""

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numpitron.runtime import configure_process  # noqa: E402

configure_process(sys.argv)

from numpitron.pipeline_parallel.schedules import closed_form_bubble  # noqa: E402

COLORS = {"F": "#4c78a8", "BW": "#f58518", "B": "#e45756", "W": "#54a24b"}
LIGHT = {"F": "#9ebde0", "BW": "#f9c27f", "B": "#f0a2a3", "W": "#a5d49f"}     # the same, a chunk > 0
SCHEDULES = (("gpipe", 1, "GPipe"), ("1f1b", 1, "1F1B"), ("interleaved", 2, "interleaved 1F1B, v = 2"),
             ("zero-bubble", 1, "zero-bubble (ZB-H1)"), ("zb-v", 2, "ZB-V"), ("dualpipev", 2, "DualPipeV"))
ROW_H, LEFT, WIDTH = 26, 70, 900


def record_iteration(schedule: str, virtual: int, microbatches: int, warmup: int = 3):
    import numpy as np

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.distributed.topology import Topology
    from numpitron.build import build_trainer

    topo = Topology.from_world(1, _world_size(), 1)
    model = ModelConfig(n_layers=2 * topo.pp, n_heads=4, d_model=128, seq_len=64)
    train = TrainConfig(micro_batch_size=4, global_batch_size=4 * microbatches)
    trainer = build_trainer(model, ParallelConfig(schedule=schedule, virtual_stages=virtual).validate(), train, topo)
    tokens = np.random.default_rng(0).integers(0, 65, 100_000).astype(np.uint16)
    for _ in range(warmup + 1):          # the last iteration is the one drawn
        trainer.train_step(tokens)
    stats = trainer.last_pipeline_stats
    per_stage = topo.world.mpi.gather((stats.events, stats.wall_s, stats.peak_in_flight), root=0)
    return topo, per_stage


def simulated_iteration(schedule: str, virtual: int, stages: int, microbatches: int):
    """The unit-cost timeline, in the shape `record_iteration` gathers: per stage
    (events, wall, peak), events (action, micro-batch, start, end, chunk)."""
    from numpitron.pipeline_parallel.schedules import make_schedule, placement_of
    from numpitron.pipeline_parallel.timeline import peak_in_flight, simulate

    placement = placement_of(schedule, stages, virtual)
    lists = [make_schedule(schedule, microbatches, stages, r, placement.v) for r in range(stages)]
    times = {}
    simulate(lists, microbatches, placement.v, v_shape=placement.v_shape, events=times)
    wall = float(max(end for _, end in times.values()))
    return [([(op.action, op.microbatch, float(times[op, r][0]), float(times[op, r][1]), op.chunk) for op in ops],
             wall, peak_in_flight(ops)) for r, ops in enumerate(lists)]


def _world_size() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size()


def draw(panels, microbatches: int, ideal: bool = False, made: str = "") -> str:
    """panels: [(schedule, v, title, per_stage)], per_stage = [(events, wall_s, peak)] by
    stage; ideal: unit-cost timelines (times in units, not seconds)."""
    stages = len(panels[0][3])
    panel_h = (stages + 2) * ROW_H
    height = panel_h * len(panels) + 66
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" height="{height}" '
           'font-family="sans-serif" font-size="12">', '<rect width="100%" height="100%" fill="white"/>']
    longest = max(wall for *_, per_stage in panels for _, wall, _ in per_stage)
    scale = WIDTH / longest
    for p, (schedule, virtual, title, per_stage) in enumerate(panels):
        top = p * panel_h + 20
        busy = [sum(event[3] - event[2] for event in events) for events, _, _ in per_stage]
        bubble = 1 - sum(busy) / sum(wall for _, wall, _ in per_stage)
        formula = closed_form_bubble(schedule, stages, microbatches, virtual)
        svg.append(f'<text x="{LEFT}" y="{top}" font-weight="bold">{title}: {"" if ideal else "measured "}bubble '
                   f'{bubble:.1%}, formula {formula:.1%}; peak in flight per stage '
                   f'{[peak for _, _, peak in per_stage]}{" chunks" if virtual > 1 else ""}</text>')
        for s, (events, wall, _) in enumerate(per_stage):
            y = top + 10 + s * ROW_H
            svg.append(f'<text x="5" y="{y + 16}">stage {s}</text>')
            svg.append(f'<rect x="{LEFT}" y="{y}" width="{wall * scale:.1f}" height="{ROW_H - 6}" fill="#eeeeee"/>')
            for op, mb, start, end, chunk in events:
                x, w = LEFT + start * scale, max((end - start) * scale, 1)
                # The chunk is the shade (a label "mb:chunk" does not fit the narrow boxes of
                # interleaving and the V); the micro-batch is written only where it fits.
                colour = (LIGHT if chunk else COLORS)[op]
                text = (f'<text x="{x + w / 2:.1f}" y="{y + 14}" fill="black" font-size="9" text-anchor="middle">'
                        f'{mb}</text>') if w >= 6 * len(str(mb)) + 2 else ""
                svg.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{ROW_H - 6}" fill="{colour}" '
                           f'stroke="white"/>{text}')
    across = f"{longest:g} units (a stage's forward: 1)" if ideal else f"{longest * 1e3:.0f} ms"
    keys = [("F", "forward"), ("BW", "whole backward"), ("B", "input half B"), ("W", "weight half W")]
    x = LEFT
    for op, name in keys:
        svg.append(f'<rect x="{x}" y="{height - 53}" width="12" height="12" fill="{COLORS[op]}"/>'
                   f'<rect x="{x + 13}" y="{height - 53}" width="12" height="12" fill="{LIGHT[op]}"/>'
                   f'<text x="{x + 30}" y="{height - 43}">{name}</text>')
        x += 40 + 7 * len(name)
    svg.append(f'<text x="{x}" y="{height - 43}">grey: idle (waiting for a neighbour)</text>')
    svg.append(f'<text x="{LEFT}" y="{height - 25}">dark: chunk 0, light: chunk 1 (interleaved, V); numbers: '
               f'micro-batch; {across} across</text>')
    made = made or (f"python benchmarks/pipeline_timeline.py --ideal {stages} --microbatches {microbatches}: the "
                    f"simulator, unit costs")
    svg.append(f'<text x="{LEFT}" y="{height - 8}" font-size="9" fill="#555">{made}</text>')
    svg.append("</svg>")
    return "\n".join(svg)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", default="docs/pipeline_timeline.svg")
    parser.add_argument("--ideal", type=int, metavar="P", help="draw the unit-cost timelines of P stages instead")
    parser.add_argument("--redraw", metavar="FILE.json", help="draw a measured run's saved events again, running nothing")
    args, _ = parser.parse_known_args()
    if args.redraw:
        saved = json.loads(Path(args.redraw).read_text())
        Path(args.out).write_text(draw(saved["panels"], saved["microbatches"], made=saved["made"]))
        print(f"wrote {args.out}")
        return
    if args.ideal:
        panels = [(schedule, virtual, title, simulated_iteration(schedule, virtual, args.ideal, args.microbatches))
                  for schedule, virtual, title in SCHEDULES]
        Path(args.out).write_text(draw(panels, args.microbatches, ideal=True))
        print(f"wrote {args.out}")
        return
    panels = []
    for schedule, virtual, title in SCHEDULES:
        topo, per_stage = record_iteration(schedule, virtual, args.microbatches)
        panels.append((schedule, virtual, title, per_stage))
    if topo.rank == 0:
        made = f"mpiexec -n {len(panels[0][3])} python benchmarks/pipeline_timeline.py on {platform.machine()}, " \
               f"{os.cpu_count()} cores"
        Path(args.out).write_text(draw(panels, args.microbatches, made=made))
        (Path(__file__).resolve().parents[1] / "docs" / "figures" / "pipeline_timeline.json").write_text(json.dumps(
            {"microbatches": args.microbatches, "made": made, "panels": panels}))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
