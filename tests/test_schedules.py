"""Every schedule, as data: complete (every F, B, W of every micro-batch and chunk exactly
once), its dependencies respected and deadlock-free (the unit-cost timeline runs to the
end), its bubble the papers' formula, its memory what the papers say; and what a
schedule cannot run is one clear error."""

from fractions import Fraction

import pytest
from mpi4py import MPI

from numpitron.config import SCHEDULES, SPLIT_BACKWARD, V_SHAPED, ParallelConfig
from numpitron.layout import check_layout
from numpitron.pipeline_parallel.placement import StagePlacement
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.model import GPTStage
from numpitron.build import build_stage
from numpitron.nn.layer import Layer
from numpitron.pipeline_parallel.executor import check_backward_splits
from numpitron.pipeline_parallel.schedules import (BACKWARD, FORWARD, Op, closed_form_bubble, format_schedule, make_schedule,
                                          placement_of)
from numpitron.pipeline_parallel.timeline import ScheduleError, ideal_bubble, peak_in_flight, simulate
from tests.harness import make_trainer, tiny_model, tiny_train


def cases():
    """(schedule, p, m, v) for p up to 8 and several m each (interleaving: m a multiple of
    p; a V: two chunks per rank and m >= 2p - 1)."""
    for name in SCHEDULES:
        for p in range(1, 9):
            if name in V_SHAPED:
                for m in sorted({2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p + 3}):
                    yield name, p, m, 2
                continue
            for v in ((2, 3) if name == "interleaved" else (1,)):
                if name == "interleaved" and p == 1:
                    continue
                step = p if name == "interleaved" else 1
                extra = {1, 3, p + 1, 2 * p + 3} if step == 1 else set()      # m below, at and above p
                for m in sorted({step, 2 * step, 3 * step, 4 * step, 5 * step} | extra):
                    yield name, p, m, v


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_complete_and_runs_to_the_end(name):
    for schedule, p, m, v in cases():
        if schedule != name:
            continue
        stages = [make_schedule(name, m, p, stage, v) for stage in range(p)]
        finish = simulate(stages, m, v, v_shape=name in V_SHAPED)      # raises if incomplete or stuck
        assert len(finish) == p and all(t > 0 for t in finish)
        split = any(op.action == "W" for ops in stages for op in ops)
        assert split == (name in SPLIT_BACKWARD)
        assert all(sum(op.action == FORWARD for op in ops) == m * v for ops in stages)


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_timeline_has_the_papers_bubble(name):
    for schedule, p, m, v in cases():
        if schedule == name and (name != "zero-bubble" or m >= p):
            assert ideal_bubble(name, p, m, v) == pytest.approx(closed_form_bubble(name, p, m, v), abs=1e-12)
            if name in V_SHAPED:        # (p-1)/2 of 1F1B's units idle per rank: half ZB-H1's bubble in time
                makespan = 3 * m + Fraction(p - 1, 2)
                assert ideal_bubble(name, p, m, v) == pytest.approx(float((p - 1) / 2 / makespan), abs=1e-12)
    # ZB-H1's bubble is a third of 1F1B's in time (Qi et al. 2024, Fig. 3): (p-1) of
    # 3m+p-1 units against 3(p-1) of 3m+3(p-1).
    p, m = 4, 8
    zb, one = ideal_bubble("zero-bubble", p, m), ideal_bubble("1f1b", p, m)
    assert zb * (3 * m + p - 1) == pytest.approx((p - 1)) and one * (3 * m + 3 * (p - 1)) == pytest.approx(3 * (p - 1))


def test_the_schedules_print_as_the_papers_draw_them():
    assert format_schedule(make_schedule("gpipe", 3, 2, 0)) == "F0 F1 F2 BW0 BW1 BW2"
    assert format_schedule(make_schedule("1f1b", 4, 2, 0)) == "F0 F1 BW0 F2 BW1 F3 BW2 BW3"
    assert format_schedule(make_schedule("1f1b", 4, 2, 1)) == "F0 BW0 F1 BW1 F2 BW2 F3 BW3"
    # the last stage of ZB-H1 runs its first W p-1 rounds late, and all of them by the end
    assert format_schedule(make_schedule("zero-bubble", 4, 3, 2)) == "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"
    assert format_schedule(make_schedule("zero-bubble", 4, 3, 0)) == "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3"
    # interleaved, rank 0 of 2 with 2 chunks: p micro-batches through chunk 0, then chunk 1
    assert format_schedule(make_schedule("interleaved", 2, 2, 0, 2)) == "F0 F1 F0:1 F1:1 BW0:1 BW1:1 BW0 BW1"
    # the V, p = 2, m = 4, rank 1 (stages 1 and 2): F0:1 follows F0 at once, in memory
    assert format_schedule(make_schedule("zb-v", 4, 2, 1)) == \
        "F0 F0:1 F1 F1:1 B0:1 W0:1 B0 W0 F2 F2:1 B1:1 W1:1 B1 W1 F3 F3:1 B2:1 B2 B3:1 B3 W2:1 W2 W3:1 W3"
    assert format_schedule(make_schedule("dualpipev", 4, 2, 1)) == \
        "F0 F0:1 F1 F1:1 F2 BW0:1 F2:1 BW0 F3 BW1:1 F3:1 BW1 BW2:1 BW2 B3:1 B3 W3:1 W3"


def test_one_f_one_b_is_its_three_phases_and_interleaving_with_one_chunk():
    """Stage r of p: a warm-up of p-r-1 forwards (all m when fewer), a steady state that
    alternates one forward with one backward, a cool-down of backwards only; and
    interleaving, its own function, reduces to exactly this with v = 1."""
    for p in range(1, 7):
        for m in (1, 2, p, p + 3, 3 * p):
            for stage in range(p):
                ops = make_schedule("1f1b", m, p, stage)
                warmup = min(p - stage - 1, m)
                steady = 2 * (m - warmup)
                assert all(op.action == FORWARD for op in ops[:warmup])
                assert [op.action for op in ops[warmup:warmup + steady]] == [FORWARD, BACKWARD] * (m - warmup)
                assert all(op.action == BACKWARD for op in ops[warmup + steady:])
                assert [op.microbatch for op in ops if op.action == FORWARD] == list(range(m))
                assert [op.microbatch for op in ops if op.action == BACKWARD] == list(range(m))
                assert ops == make_schedule("interleaved", m, p, stage, 1)


def test_peak_in_flight_per_stage():
    p, m = 4, 8
    assert [peak_in_flight(make_schedule("gpipe", m, p, s)) for s in range(p)] == [m] * p
    assert [peak_in_flight(make_schedule("1f1b", m, p, s)) for s in range(p)] == [4, 3, 2, 1]
    # ZB-H1: every stage holds p micro-batches (their caches live until W), the first
    # stage no more than under 1F1B (Qi et al. 2024, §2.1)
    assert [peak_in_flight(make_schedule("zero-bubble", m, p, s)) for s in range(p)] == [4, 4, 4, 4]
    # interleaved: (v-1)p + p - r chunks of 1/v of the layers each
    assert [peak_in_flight(make_schedule("interleaved", m, p, s, 2)) for s in range(p)] == [8, 7, 6, 5]


def test_the_v_places_the_first_and_last_stage_on_rank_0():
    """Rank r holds virtual stages r and 2p-1-r; the loop (interleaving) r, p+r, ...;
    `holder` inverts `stage` for both."""
    for p in range(1, 9):
        v_shape, loop = StagePlacement(p, 2, True), StagePlacement(p, 2)
        assert [(v_shape.stage(r, 0), v_shape.stage(r, 1)) for r in range(p)] == [(r, 2 * p - 1 - r) for r in range(p)]
        assert [(loop.stage(r, 0), loop.stage(r, 1)) for r in range(p)] == [(r, p + r) for r in range(p)]
        assert v_shape.rank_of(0) == v_shape.rank_of(2 * p - 1) == 0 and loop.rank_of(2 * p - 1) == p - 1
        assert v_shape.rank_of(p - 1) == v_shape.rank_of(p) == p - 1          # the bottom of the V: no message
        for placement in (v_shape, loop, StagePlacement(p, 3, True)):
            assert sorted(placement.stage(r, c) for r in range(p) for c in range(placement.v)) == \
                list(range(placement.stages))
            assert all(placement.holder(placement.stage(r, c)) == (r, c) for r in range(p) for c in range(placement.v))
    assert placement_of("zb-v", 4) == StagePlacement(4, 2, True) and placement_of("interleaved", 4, 3).v == 3


def test_v_schedules_bubble_and_memory_against_the_papers():
    """ZB-V (Qi et al. 2024): every rank busy from its first operation to its last (the
    paper's zero bubble; only the start, r chunk forwards on rank r, is idle) in 1F1B's
    memory, 2p chunks of half a stage. DualPipeV: 2p + 1 chunks (the DualPipe README's
    PP + 1 with PP = 2p stages), and with its pairs started together the README's
    bubble (PP/2 - 1)(F&B + B - 3W), F&B = F + B on a CPU; started apart, as the
    executor does, half of it."""
    for p in range(2, 9):
        for m in (2 * p - 1, 3 * p, 4 * p + 1):
            zbv, dpv = ([make_schedule(name, m, p, r) for r in range(p)] for name in ("zb-v", "dualpipev"))
            assert [peak_in_flight(ops) for ops in zbv] == [2 * p] * p
            assert max(peak_in_flight(ops) for ops in dpv) == 2 * p + 1
            events = {}
            finish = simulate(zbv, m, 2, v_shape=True, events=events)
            for r in range(p):
                spans = [span for (op, rank), span in events.items() if rank == r]
                start = min(begin for begin, _ in spans)
                assert start == Fraction(r, 2) and finish[r] - start == 3 * m        # no gap once started
            chunk = {"F": Fraction(1, 2), "B": Fraction(2, 2), "W": Fraction(1, 2)}      # B: a whole backward
            readme = (p - 1) * ((chunk["F"] + chunk["B"]) + chunk["B"] - 3 * chunk["W"])
            for paired, idle in ((True, readme), (False, readme / 2)):
                assert max(simulate(dpv, m, 2, v_shape=True, paired=paired)) == 3 * m + idle


def test_the_checker_finds_broken_schedules():
    m, p = 4, 2
    good = [make_schedule("1f1b", m, p, s) for s in range(p)]
    missing = [good[0][:-1], good[1]]
    with pytest.raises(ScheduleError, match="missing"):
        simulate(missing, m)
    twice = [good[0] + [Op("F", 0)], good[1]]
    with pytest.raises(ScheduleError, match="repeated"):
        simulate(twice, m)
    # the last stage asking for micro-batch 1's gradient before its forward: a wait forever
    swapped = [good[0], [Op("F", 0), Op("BW", 1), Op("F", 1), Op("BW", 0)] + good[1][4:]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(swapped, m)
    # W before its B (same stage): never runnable
    zb = make_schedule("zero-bubble", 2, 1, 0)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([[zb[0], zb[2], zb[1]] + zb[3:]], 2)


@pytest.mark.parametrize("layers, pipeline, virtual, schedule, global_batch, message", [
    (4, 2, 4, "interleaved", 8, "n_layers (4) must be divisible by pipeline-parallel size x virtual stages (2 x 4 = 8)"),
    (4, 2, 2, "interleaved", 6, "3 micro-batches per step is not a multiple of 2"),
    (4, 1, 2, "interleaved", 8, "it needs --pipeline-parallel-size 2 or more"),
    (4, 2, 1, "interleaved", 8, "--pipeline-schedule interleaved and --virtual-stages 2 or more go together"),
    (4, 2, 2, "zero-bubble", 8, "--pipeline-schedule interleaved and --virtual-stages 2 or more go together"),
    (4, 2, 3, "zb-v", 8, "--pipeline-schedule zb-v places exactly two chunks on each rank (a V)"),
    (6, 2, 1, "dualpipev", 8, "n_layers (6) must be divisible by 2 x the pipeline-parallel size (4)"),
    (4, 2, 1, "dualpipev", 4, "needs at least 2 x pipeline-parallel size - 1 = 3 micro-batches per step"),
])
def test_what_a_schedule_cannot_run_is_one_clear_error(layers, pipeline, virtual, schedule, global_batch, message):
    with pytest.raises(UserError) as error:
        parallel = ParallelConfig(schedule=schedule, virtual_stages=virtual).validate()
        check_layout(tiny_model(n_layers=layers), tiny_train(global_batch_size=global_batch), (1, pipeline, 1, 1),
                     parallel)
    assert message in str(error.value) and "\n" not in str(error.value)


class WholeBackwardOnly(Layer):
    """A layer with only a whole backward: it cannot hand a schedule its two halves."""

    def forward(self, x, **context):
        return x, {}

    def backward(self, dy, cache):
        return dy


def test_zero_bubble_refuses_a_layer_that_cannot_split_its_backward():
    model = build_stage(tiny_model(), Topology.serial())
    check_backward_splits(model, "zero-bubble")            # every layer of the GPT splits
    model.layers.append(WholeBackwardOnly())
    check_backward_splits(model, "1f1b")                    # a whole backward is all 1F1B needs
    with pytest.raises(UserError, match="WholeBackwardOnly has only a whole backward"):
        check_backward_splits(model, "zero-bubble")


@pytest.mark.parallel(nprocs=2)
def test_a_layer_on_one_stage_only_fails_every_rank_alike(monkeypatch):
    """Only the last stage holds the layer that cannot split: both ranks raise the same
    one-line error instead of one going on into the pipeline alone."""
    import numpitron.build

    class StageWithOddLayer(GPTStage):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.last:
                self.layers.append(WholeBackwardOnly())
    monkeypatch.setattr(numpitron.build, "GPTStage", StageWithOddLayer)
    with pytest.raises(UserError, match="WholeBackwardOnly has only a whole backward") as error:
        make_trainer(pipeline=2, schedule="zero-bubble")
    assert MPI.COMM_WORLD.allgather(str(error.value)) == [str(error.value)] * 2


def test_a_message_between_stages_waits_for_its_link_and_crosses_it():
    """The planner's pipeline on links (docs/15-planning-a-run.md): 1F1B over two stages, one micro-batch,
    a forward 1 and a backward 2. Free messages: 1 + 1 + 2 + 2 = 6. A message of 0.5 each
    way adds 1. Two micro-batches of GPipe on a link of 3 a message: the second
    activation waits for the first to leave the link, so stage 1 starts its second
    forward at 1 + 3 + 3 = 7, not at 2 + 3."""
    from numpitron.pipeline_parallel.schedules import gpipe, one_f_one_b
    lists = [one_f_one_b(1, 2, stage) for stage in range(2)]
    assert max(simulate(lists, 1)) == 6
    assert max(simulate(lists, 1, transfer=lambda a, b: 0.5)) == 7
    events = {}
    simulate([gpipe(2, 2, stage) for stage in range(2)], 2, transfer=lambda a, b: 3.0, events=events)
    starts = {(str(op), rank): start for (op, rank), (start, _) in events.items()}
    assert starts[("F0", 1)] == 4 and starts[("F1", 1)] == 7
