"""Where each way of training across a slow link wins (plan/crossover.py): the bytes it
prices are a run's, its crossover rate is where the two times meet, and a method whose
own work outweighs what it saves never wins."""

import math

import pytest
from mpi4py import MPI

from numpitron.distributed.topology import Mesh
from numpitron.plan.accounting import Rank
from numpitron.plan.crossover import Method, TwoWay, crossing, crossings, method, seconds_per_iteration, wins
from numpitron.plan.traffic import comm_bytes, comm_calls
from tests.harness import SMALLER, assert_on_every_rank, make_trainer, tiny_model, tiny_tokens, tiny_train
from tests.test_diloco import diloco_trainer

MODEL = tiny_model(**SMALLER)
ACROSS = {"dp_cp": (2, 2), "diloco": (2, 2), "diloco_metrics": (2, 2)}     # one rank on each of two hosts
CPU = dict(compute_s=0.5, alpha=1e-4, beta_inside=1e8)


def counted(trainer, steps: int) -> tuple[dict, dict]:
    """Bytes and calls per iteration by kind, as CommStats counts them over `steps` steps."""
    trainer.topo.stats.reset()
    for _ in range(steps):
        trainer.train_step(tiny_tokens())
    snapshot = trainer.topo.stats.snapshot().items()
    return ({k: e["bytes"] / steps for k, e in snapshot if e["bytes"]}, {k: e["calls"] / steps for k, e in snapshot})


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("setting", [dict(), dict(grad_compression="int8"),
                                     dict(grad_compression="powersgd", powersgd_rank=2),
                                     dict(diloco_inner_steps=2), dict(diloco_inner_steps=4, diloco_fragments=2,
                                                                      diloco_overlap_steps=1)],
                         ids=["dp", "int8", "powersgd", "diloco", "streaming"])
def test_the_bytes_it_prices_are_a_runs(setting):
    """From the planner's bytes and calls, and from a run's counted over a whole round:
    the same bytes across hosts, inside them and on the link, and the same messages."""
    diloco = "diloco_inner_steps" in setting
    if diloco:
        train = tiny_train(diloco_replicas=2, max_iters=20, **setting)
        trainer = diloco_trainer(train, Mesh(1, 1, 2))
        trainer.train_step(tiny_tokens())            # a step in: the round counted wraps around
        steps = setting["diloco_inner_steps"]
    else:
        train, steps = tiny_train(), 1
        trainer = make_trainer(MODEL, train, data=2, **setting)
    run = method("run", *counted(trainer, steps), ACROSS, per_host=1)
    rank = Rank(1, 1, 2, 1, dp_rank=MPI.COMM_WORLD.rank)
    plan = method("run", comm_bytes(MODEL, trainer.parallel_cfg, train, rank),
                  comm_calls(MODEL, trainer.parallel_cfg, train, rank), ACROSS, per_host=1)
    assert run[0].crossing > 0
    assert_on_every_rank({"priced": (run, plan)})


def test_what_crosses_two_hosts_of_two():
    """MPICH's algorithms on 2 hosts of 2 ranks, from CommStats' ring counts: recursive
    halving pairs a host's ranks first, so each rank sends half the buffer across; a
    ring all-gather sends all three blocks from one rank a host; a 2-rank group across
    (DiLoCo's replicas) sends the whole buffer from every rank."""
    B, m = 4_000_000, 1_000_000
    dp = crossing("dp_cp.all_reduce", 2 * 3 / 4 * B, ranks=4, hosts=2, per_host=2)
    assert dp == {"crossing": B / 2, "inside": B, "link": 2 * B, "both_ways": B / 2, "message": B / 4}
    ring = crossing("dp_cp.all_gather", 3 * m, ranks=4, hosts=2, per_host=2)
    assert ring == {"crossing": 3 * m, "inside": 0.0, "link": 6 * m, "both_ways": 0.0, "message": m}
    outer = crossing("diloco.all_reduce", B, ranks=2, hosts=2, per_host=2)
    assert outer == {"crossing": B, "inside": 0.0, "link": 4 * B, "both_ways": B, "message": B / 2}
    swap = crossing("diloco.all_gather", m, ranks=2, hosts=2, per_host=2)      # a ring of one rank a host
    assert swap["both_ways"] == swap["crossing"] == m
    assert crossing("dp_cp.all_reduce", B, ranks=2, hosts=1, per_host=2)["crossing"] == 0.0


def test_the_crossover_rate_is_where_the_times_meet():
    dp = Method("dp", crossing=2e6, inside=1e6, messages=4)
    cheap = Method("powersgd", crossing=1e5, messages=4, own_s=0.05)
    [beta] = crossings(cheap, dp, **CPU)
    closed = (2e6 - 1e5) / (0.05 + (0 - 1e6) / CPU["beta_inside"])            # the module's β*
    assert beta == pytest.approx(closed, rel=1e-9)
    args = (CPU["compute_s"], CPU["alpha"])
    at = [seconds_per_iteration(m, *args, beta, CPU["beta_inside"]) for m in (cheap, dp)]
    assert at[0] == pytest.approx(at[1], rel=1e-9)
    slower, faster = (seconds_per_iteration(cheap, *args, b, CPU["beta_inside"]) -
                      seconds_per_iteration(dp, *args, b, CPU["beta_inside"]) for b in (2 * beta, beta / 2))
    assert slower > 0 > faster                       # it wins below β*, loses above


def test_a_streamed_exchange_hidden_behind_its_steps_still_meets_dp_once():
    dp = Method("dp", crossing=2e6, messages=4)
    streaming = Method("streaming", crossing=4e4, messages=0.2, own_s=1e-3, streaming=(5, 50, 2))
    [beta] = crossings(streaming, dp, **CPU)
    at = [seconds_per_iteration(m, CPU["compute_s"], CPU["alpha"], beta, CPU["beta_inside"]) for m in (streaming, dp)]
    assert at[0] == pytest.approx(at[1], rel=1e-6)
    # at 1 MB/s a fragment's 400 kB take 0.4 s, 2 steps of 0.5 s hide them: only its own work shows
    assert seconds_per_iteration(streaming, CPU["compute_s"], CPU["alpha"], 1e6, CPU["beta_inside"]) == \
        pytest.approx(CPU["compute_s"] + 1e-3)


def test_a_method_whose_own_work_outweighs_its_savings_never_wins():
    """int8 on two hosts of two: its ring sends 3/4 of the float32 buffer across from one
    rank, plain dp's halving half of it from each, so it saves nothing to pay its work with."""
    B = 4_000_000
    dp = method("dp", {"dp_cp.all_reduce": 1.5 * B}, {"dp_cp.all_reduce": 1}, {"dp_cp": (4, 2)}, per_host=2)[0]
    int8 = method("int8", {"dp_cp.all_gather": 3 * (B / 4 + 64)}, {"dp_cp.all_gather": 2}, {"dp_cp": (4, 2)},
                  per_host=2, own_s=0.05)[0]
    assert int8.crossing > dp.crossing
    assert crossings(int8, dp, **CPU) == [] and not wins(int8, dp, 1.0, **CPU)
    free = Method("free", crossing=0.0, messages=dp.messages, inside=dp.inside)
    assert crossings(free, dp, **CPU) == [] and wins(free, dp, 1.0, **CPU)      # saves bytes, costs nothing


def test_a_method_that_sends_more_across_but_less_inside_wins_above_its_crossover():
    """int8 with little work of its own: its ring sends more across than plain dp's halving
    but nothing inside the host in series, so it loses on a slow card and wins on a fast one."""
    B = 4_000_000
    dp = method("dp", {"dp_cp.all_reduce": 1.5 * B}, {"dp_cp.all_reduce": 1}, {"dp_cp": (4, 2)}, per_host=2)[0]
    int8 = method("int8", {"dp_cp.all_gather": 3 * (B / 4 + 64)}, {"dp_cp.all_gather": 2}, {"dp_cp": (4, 2)},
                  per_host=2, own_s=0.001)[0]
    [beta] = crossings(int8, dp, **CPU)
    args = (CPU["compute_s"], CPU["alpha"], CPU["beta_inside"])
    assert wins(int8, dp, 2 * beta, *args) and not wins(int8, dp, beta / 2, *args)


def test_a_slow_two_way_card_lets_the_one_way_ring_win_below_a_second_rate():
    """Plain dp's halving swaps across hosts both ways at once; int8's ring sends one way
    from each card. If a card gives each direction only e of β at low rates, plain dp
    slows by 1/e there and int8 wins again below a second crossing: won, lost, won."""
    B = 4_000_000
    dp = method("dp", {"dp_cp.all_reduce": 1.5 * B}, {"dp_cp.all_reduce": 1}, {"dp_cp": (4, 2)}, per_host=2)[0]
    int8 = method("int8", {"dp_cp.all_gather": 3 * (B / 4 + 64)}, {"dp_cp.all_gather": 2}, {"dp_cp": (4, 2)},
                  per_host=2, own_s=0.001)[0]
    assert dp.both_ways == ((B / 2, B / 4),) and int8.both_ways == ()
    two_way = TwoWay({1e5: {B / 4: 0.5}, 1e6: {B / 4: 0.5}, 1e7: {B / 4: 1.0}})
    args = dict(**CPU, two_way=two_way)
    low, high = crossings(int8, dp, **args)
    assert low < high and wins(int8, dp, low / 2, **args) and not wins(int8, dp, math.sqrt(low * high), **args)
    assert wins(int8, dp, 2 * high, **args)
    t = seconds_per_iteration(dp, CPU["compute_s"], CPU["alpha"], 1e5, CPU["beta_inside"], two_way)
    plain = seconds_per_iteration(dp, CPU["compute_s"], CPU["alpha"], 1e5, CPU["beta_inside"])
    assert t - plain == pytest.approx(B / 2 / 1e5)                    # B / 2 at half the rate: B / 2 / β more


def test_the_two_way_share_is_interpolated_on_logarithms_and_held_beyond():
    e = TwoWay({1e6: {1e5: 0.4, 1e7: 0.8}, 1e8: {1e5: 1.0, 1e7: 1.0}})
    assert e(1e6, 1e6) == pytest.approx(0.6) and e(1e7, 1e5) == pytest.approx(0.7)
    assert e(1e3, 1e9) == 0.8 and e(1e9, 1.0) == 1.0
