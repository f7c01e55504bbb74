"""A forward and a backward chunk run as one pair (chunk_pairing/, DeepSeek-V3 §3.2.1):
each chunk's all-to-alls travel while the other computes. The pairs come from the
schedule's lists, only where every rank's pairs can wait for both inputs; with experts,
ep = 2 and pp = 2, DualPipeV and 1F1B train exactly like one process (float64, 1e-10)
with the pairing on and off, and the pairs did hand over."""

import pytest

from numpitron.chunk_pairing.executor import PairedSchedule, choose_pairs, pairs, runnable
from numpitron.chunk_pairing.pair import ChunkPair
from numpitron.pipeline_parallel.schedules import make_schedule, placement_of
from tests.harness import assert_on_every_rank, check_mesh

SHARED = dict(num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_expert_hidden=16)


def paired_ops(name: str, m: int, p: int, rank: int, v: int = 1) -> list[str]:
    placement = placement_of(name, p, v)
    ops = make_schedule(name, m, p, rank, placement.v)
    return [" ".join(str(ops[i]) for i in group) for group in choose_pairs(name, m, placement)[rank] if len(group) == 2]


def test_the_pairs_are_the_steady_states_forward_and_backward():
    # rank 0: F0 F1 F2 F0:1 B0:1 W0:1 F1:1 [F3 BW1:1] [F2:1 BW0] BW2:1 [F3:1 BW1] BW3:1 B2 W2 B3 W3
    assert paired_ops("dualpipev", 4, 2, 0) == ["F3 BW1:1", "F2:1 BW0", "F3:1 BW1"]
    assert paired_ops("dualpipev", 4, 2, 1) == ["F2 BW0:1", "F2:1 BW0", "F3 BW1:1", "F3:1 BW1"]
    assert paired_ops("1f1b", 4, 2, 0) == ["F1 BW0", "F2 BW1", "F3 BW2"]
    assert paired_ops("1f1b", 4, 2, 1) == []          # the last stage: F and BW of one micro-batch
    assert paired_ops("1f1b", 4, 1, 0) == ["BW0 F1", "BW1 F2", "BW2 F3"]      # pp = 1: combined 1F1B


def test_pairs_run_only_where_no_rank_waits_forever():
    placement = placement_of("1f1b", 2)
    lists = [make_schedule("1f1b", 4, 2, rank) for rank in range(2)]
    assert runnable(lists, [pairs(ops) for ops in lists], placement)
    # BW-then-F on the last stage: its BW0 F1 waits for F1's activation, which stage 0 sends
    # after its F1 BW0, which waits for the last stage's BW0: a cycle.
    assert not runnable(lists, [pairs(ops, both_orders=True) for ops in lists], placement)
    # GPipe pairs its last forward with the first backward, whose gradient needs the next
    # stage's last forward, which waits for this stage's. Likewise 1F1B with m < p.
    assert paired_ops("gpipe", 4, 2, 0) == paired_ops("gpipe", 4, 2, 1) == []
    assert paired_ops("1f1b", 2, 3, 0) == []
    assert pairs(make_schedule("gpipe", 4, 2, 0)) != [(i,) for i in range(8)]      # there was a pair to refuse


def test_a_pair_hands_over_at_every_wait_and_one_chunk_runs_at_a_time():
    pair, order = ChunkPair(), []

    def chunk(name):
        def work():
            for k in range(3):
                order.append(f"{name}{k}")
                pair.meanwhile(comm=None, pending=None) if k < 2 else None
            return name
        return work
    pair.in_flight = []
    pair.progress = lambda: None             # nothing in flight to test here
    results, held = pair.run(chunk("F"), chunk("B"))
    assert results == ["F", "B"] and all(t >= 0 for t in held)
    assert order == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert pair.handovers == 4


def test_before_an_all_to_all_starts_the_other_chunks_are_finished():
    """settle: the all-to-alls of the chunk not running are waited for, so their last
    messages go before the new rows; with none in flight (outside a pair) nothing is."""
    class Comm:
        def __init__(self):
            self.waited = []

        def wait(self, pending):
            self.waited.append(pending)

    pair, comm, seen = ChunkPair(), Comm(), {}
    pair.settle()
    assert comm.waited == []

    def forward():
        pair.meanwhile(comm, "F's dispatch")            # hands over while its rows travel
        seen["in flight after"] = list(pair.in_flight)

    def backward():
        pair.settle()                                   # about to start an all-to-all of its own
        seen["waited before starting"] = list(comm.waited)
    pair.progress = lambda: None
    pair.run(forward, backward)
    assert seen == {"waited before starting": ["F's dispatch"], "in flight after": []}


def test_an_error_in_a_chunk_reaches_the_caller():
    def bad():
        raise ValueError("inside a chunk")
    with pytest.raises(ValueError, match="inside a chunk"):
        ChunkPair().run(bad, lambda: None)


def paired_peak(name: str, m: int, p: int, rank: int, v: int = 1) -> int:
    """The most chunk caches alive at once when each pair holds both of its own: a
    BW-then-F pair keeps the backward's cache while the forward makes its own."""
    placement = placement_of(name, p, v)
    ops, alive, peak = make_schedule(name, m, p, rank, placement.v), 0, 0
    for group in choose_pairs(name, m, placement)[rank]:
        alive += sum(ops[i].action == "F" for i in group)
        peak = max(peak, alive)
        alive -= sum(ops[i].action in ("BW", "W") for i in group)
    return peak


def _check(mesh: dict):
    run = check_mesh(mesh, model=SHARED, global_batch_size=16)
    schedule = run.trainer.run_schedule
    paired = isinstance(schedule, PairedSchedule)
    assert_on_every_rank({"paired exactly when the overlap is on": (paired, mesh["moe_a2a_overlap"])})
    if paired:
        topo = run.trainer.topo
        expected = 10 * len(paired_ops(mesh["schedule"], run.trainer.num_microbatches, topo.pp, topo.pp_rank,
                                       mesh.get("virtual_stages", 1)))
        m, v, stats = run.trainer.num_microbatches, mesh.get("virtual_stages", 1), run.trainer.last_pipeline_stats
        assert_on_every_rank({"every operation timed once": (len(stats.events), len(make_schedule(
                                  mesh["schedule"], m, topo.pp, topo.pp_rank, placement_of(mesh["schedule"], topo.pp, v).v))),
                              "caches alive at once": (stats.peak_in_flight,
                                                       paired_peak(mesh["schedule"], m, topo.pp, topo.pp_rank, v)),
                              "every pair ran as one": (schedule.pairs_run, expected),
                              "and handed over": (schedule.pair.handovers > 0, expected > 0)})


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("schedule", ["dualpipev", "1f1b"])
def test_ep2_pp2_matches_serial_paired_and_not(schedule):
    for overlap in (True, False):
        _check(dict(pipeline=2, data=2, expert=2, schedule=schedule, moe_a2a_overlap=overlap))


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("schedule", ["interleaved", "gpipe"])
def test_interleaved_pairs_and_gpipe_runs_unpaired_both_like_one_process(schedule):
    """Interleaved 1F1B pairs its steady state; GPipe's one F-BW boundary would deadlock
    paired, so it runs in turn (no pair, no hand-over)."""
    _check(dict(pipeline=2, data=2, expert=2, schedule=schedule, moe_a2a_overlap=True,
                **({"virtual_stages": 2} if schedule == "interleaved" else {})))


@pytest.mark.parallel(nprocs=4)
def test_ep_by_tp_paired_on_one_stage_matches_serial():
    """pp = 1 pairs each BW with the next micro-batch's F; tp's all-reduces and ep's
    all-to-alls of the two chunks interleave alike on every rank."""
    _check(dict(tensor=2, data=2, expert=2, schedule="1f1b", moe_a2a_overlap=True))


@pytest.mark.parallel(nprocs=4)
def test_tp2_pp2_dualpipev_paired_matches_serial():
    """The tp all-reduces of two interleaved chunks keep one order on both tp ranks."""
    _check(dict(tensor=2, pipeline=2, schedule="dualpipev", moe_a2a_overlap=True))


@pytest.mark.parametrize("inter_bandwidth", [None, 1e9, 1e5], ids=["one-node", "fast-link", "slow-link"])
def test_the_planner_hides_in_each_pair_min_of_a_chunks_all_to_alls_and_the_other_chunks_compute(inter_bandwidth):
    """pp = 2, dp = ep = 2, on one node or on hosts of one rank (the experts split across
    hosts): per pair min(a_F, c_BW) + min(a_BW, c_F), as many pairs as the stage's list
    holds; off, nothing hidden. On one node the exposed communication is larger by exactly
    that (on links the pipeline's messages are priced on its timeline, which moves too)."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    device = load_device("this-machine") if inter_bandwidth is None else \
        replace(load_device("this-machine"), ranks_per_host=1, intra_bandwidth=1e9, inter_bandwidth=inter_bandwidth,
                intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    model = ModelConfig(num_experts=4, moe_shared_experts=1).validate()
    train = TrainConfig(micro_batch_size=4, global_batch_size=64).validate()
    on, off = (plan(model, ParallelConfig(schedule="dualpipev", moe_a2a_overlap=overlap).validate(), train,
                    (1, 2, 2, 1, 0, 2), device) for overlap in (True, False))
    m = on["microbatches"]
    for stage, stage_off in zip(on["stages"], off["stages"]):
        a, t = stage["all_to_all"], stage["time_s"]
        compute = t["matmul"] + t["elementwise"] + t["exp"] + t["calls"]          # m micro-batches, both chunks
        assert a["pairs"] == len(paired_ops("dualpipev", m, 2, stage["stage"])) > 0
        assert a["a_f"] + a["a_bw"] == pytest.approx(a["all_to_all"] / (2 * m)) and a["a_bw"] == pytest.approx(a["a_f"])
        assert a["c_f"] + a["c_bw"] == pytest.approx(compute / (2 * m)) and a["c_bw"] == pytest.approx(2 * a["c_f"])
        assert a["hidden"] == pytest.approx(a["pairs"] * (min(a["a_f"], a["c_bw"]) + min(a["a_bw"], a["c_f"])))
        assert a["exposed_paired"] == pytest.approx(a["all_to_all"] - a["hidden"])
        assert stage_off["all_to_all"]["hidden"] == 0.0
        if inter_bandwidth is None:
            assert stage_off["time_s"]["exposed_comm"] - t["exposed_comm"] == pytest.approx(a["hidden"])
        elif inter_bandwidth < 1e6:      # the link is the bottleneck: a pair hides its whole computation
            assert a["hidden"] == pytest.approx(a["pairs"] * (a["c_f"] + a["c_bw"]))
        else:                          # compute is: a pair hides both chunks' all-to-alls
            assert a["hidden"] == pytest.approx(a["pairs"] * (a["a_f"] + a["a_bw"]))


def test_a_paired_timeline_idles_what_the_dualpipe_readme_says_and_the_planner_uses_it():
    """A pair starts once both inputs are in: DualPipeV's idle time is the README's p - 1
    units, (p - 1)/(3m + p - 1), twice the unpaired (p - 1)/(6m + p - 1); 1F1B's forward
    waits for the backward's gradient, a third of the timeline at p = 2, m = 4."""
    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.pipeline_parallel.timeline import ideal_bubble
    from numpitron.plan.a2a_overlap import paired_bubble
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    assert paired_bubble("dualpipev", 4, 8, 2) == pytest.approx(3 / 27)
    assert ideal_bubble("dualpipev", 4, 8, 2) == pytest.approx(3 / 51)
    assert paired_bubble("1f1b", 2, 4) == pytest.approx(1 / 3) and ideal_bubble("1f1b", 2, 4) == pytest.approx(1 / 5)
    assert paired_bubble("gpipe", 2, 4) == ideal_bubble("gpipe", 2, 4)          # nothing pairs
    model, train = ModelConfig(num_experts=4).validate(), TrainConfig(micro_batch_size=4, global_batch_size=64).validate()
    for overlap, expected in ((True, paired_bubble), (False, ideal_bubble)):
        parallel = ParallelConfig(schedule="dualpipev", moe_a2a_overlap=overlap).validate()
        result = plan(model, parallel, train, (1, 2, 2, 1, 0, 2), load_device("this-machine"))
        assert result["bubble"] == expected("dualpipev", 2, result["microbatches"], 2)
