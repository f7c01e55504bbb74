"""ZeRO stages 2 and 3 (data_parallel/zero.py, data_parallel/zero3.py): the same training as one
process in float64, with accumulation, tp, pp (stage 2), cp, sequence parallelism,
recomputation and a clip that bites; memory and traffic as docs/09-zero-2-and-3.md derives them
(the byte-exact comparison with the planner's accounting is in test_plan_counts.py)."""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.config import ParallelConfig
from numpitron.layout import check_layout
from numpitron.errors import UserError
from tests.harness import assert_on_every_rank, check_mesh, make_trainer, mesh_id, tiny_model, tiny_tokens, tiny_train

TWO_RANKS = [dict(data=2, zero_stage=2, bucket_size=2000), dict(data=2, zero_stage=3),
             dict(data=2, zero_stage=2, overlap_grad_reduce=False), dict(data=2, zero_stage=3, recompute="full", overlap_grad_reduce=False)]
FOUR_RANKS = [dict(data=4, zero_stage=2), dict(data=4, zero_stage=3), dict(tensor=2, data=2, zero_stage=2),
              dict(tensor=2, data=2, zero_stage=3, bucket_size=1000), dict(pipeline=2, data=2, zero_stage=2),
              dict(context=2, data=2, zero_stage=3), dict(tensor=2, data=2, zero_stage=2, sequence_parallel=True),
              dict(pipeline=2, data=2, zero_stage=2, schedule="gpipe", recompute="selective"),
              dict(pipeline=2, data=2, zero_stage=2, schedule="zero-bubble")]


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", TWO_RANKS, ids=mesh_id)
def test_two_ranks_match_serial(mesh):
    check_mesh(mesh)                   # dp = 2: two micro-batches accumulate per step


@pytest.mark.parallel(nprocs=2)
def test_clipping_that_bites_and_long_accumulation_stay_exact():
    for stage in (2, 3):
        check_mesh(dict(data=2, zero_stage=stage), grad_clip=0.05)
        check_mesh(dict(data=2, zero_stage=stage), micro_batch_size=1)      # 4 micro-batches


@pytest.mark.parallel(nprocs=4)
def test_four_ranks_match_serial():
    for mesh in FOUR_RANKS:            # one launch: four ranks on two cores start slowly
        check_mesh(mesh)
    check_mesh(dict(tensor=2, data=2, zero_stage=3), grad_clip=0.05)


@pytest.mark.parallel(nprocs=2)
def test_zero2_reduce_scatters_during_the_backward_and_frees_the_whole_gradient():
    """Every bucket but the tied embedding's starts inside the backward; between steps
    only this rank's slice of the gradients exists."""
    trainer = make_trainer(train_cfg=tiny_train(global_batch_size=4), data=2, zero_stage=2, bucket_size=3000)
    buckets, started = trainer.optimizer.buckets, []
    original = trainer.model.finalize_grads

    def finalize(grads_ready):
        started.append(len(buckets.pending))
        original(grads_ready)
    trainer.model.finalize_grads = finalize
    trainer.topo.stats.reset()
    trainer.train_step(tiny_tokens())
    snap = trainer.topo.stats.snapshot()
    store = trainer.model.store
    assert_on_every_rank({
        "started in the backward": (started[0], len(buckets.buckets) - 1),
        "one reduce-scatter per bucket": (snap["dp_shard.reduce_scatter"]["calls"], len(buckets.buckets)),
        "whole gradient freed": store.grad is None and all(p.grad is None for p in store.params),
        "slice kept": trainer.optimizer.owned.grads.size == store.size // 2,
    })


@pytest.mark.parallel(nprocs=2)
def test_zero3_holds_only_slices_between_steps_and_gathers_each_block_twice_per_microbatch():
    trainer = make_trainer(data=2, zero_stage=3)      # global batch 8 of micro-batches of 2: m = 2
    trainer.train_step(tiny_tokens())
    trainer.topo.stats.reset()
    trainer.train_step(tiny_tokens())
    snap = trainer.topo.stats.snapshot()
    store, opt, m, blocks = trainer.model.store, trainer.optimizer, 2, len(trainer.model.blocks)
    units = opt.gatherer.units
    root_ranges, block_ranges = len(units[-1].ranges), sum(len(units[k].ranges) for k in range(blocks))
    assert_on_every_rank({
        "no whole buffers": store.data is None and store.grad is None,
        "no gathered layer left": all(p.data is None and p.grad is None for p in store.params),
        "param slice": opt.param_shard.size == store.size // 2,
        # the root once per step, each block in every micro-batch's forward and backward
        "all-gathers": (snap["dp_shard.all_gather"]["calls"], root_ranges + 2 * m * block_ranges),
        "reduce-scatters": (snap["dp_shard.reduce_scatter"]["calls"], root_ranges + m * block_ranges),
        "gathered peak is the root and two blocks": (
            opt.gatherer.peak_params, units[-1].nelements + units[0].nelements + units[1].nelements),
    })


@pytest.mark.parallel(nprocs=2)
def test_stage3_with_m1_moves_about_one_and_a_half_all_reduces():
    """Rajbhandari et al. 2020, §7.2.2: stage 3 adds one all-gather of the parameters to
    what an all-reduce moves. Here the root is not gathered again for the backward, so
    the ratio is 1.5 less half the root's share."""
    tokens, moved = tiny_tokens(), {}
    for stage in (0, 3):
        trainer = make_trainer(train_cfg=tiny_train(global_batch_size=4), data=2, zero_stage=stage)     # m = 1
        trainer.topo.stats.reset()
        trainer.train_step(tokens)
        snap = trainer.topo.stats.snapshot()
        # Summed over the ranks: where the slices fall, one rank may own a whole block.
        moved[stage] = MPI.COMM_WORLD.allreduce(
            sum(v["bytes"] for k, v in snap.items() if k.startswith(("dp_cp.", "dp_shard.")) and v["bytes"] > 8))
        if stage == 3:
            units, size = trainer.optimizer.gatherer.units, trainer.model.store.size
    ratio = moved[3] / moved[0]
    expected = 1.5 - 0.5 * units[-1].nelements / size
    assert_on_every_rank({"ratio": abs(ratio - expected) < 0.02, "below 1.5": ratio < 1.5})


def test_stage3_on_one_process_is_bit_for_bit_the_plain_run():
    """dp = 1: every gather and reduce-scatter is a copy, so nothing may change a bit."""
    tokens = tiny_tokens()
    plain, sharded = make_trainer(), make_trainer(zero_stage=3)
    for _ in range(3):
        assert plain.train_step(tokens) == sharded.train_step(tokens)
    assert np.array_equal(plain.optimizer.state.whole("params")[:plain.model.store.numel],
                          sharded.optimizer.state.whole("params")[:plain.model.store.numel])


@pytest.mark.parametrize("mesh, sequence_parallel, schedule, message", [
    ((1, 2, 1, 1), False, "1f1b", "again for every micro-batch"),
    ((2, 1, 1, 1), True, "1f1b", "only after the whole backward"),
    ((1, 1, 2, 1), False, "zero-bubble", "splits that backward into two passes")])
def test_stage3_refuses_what_it_cannot_do_in_one_line(mesh, sequence_parallel, schedule, message):
    parallel = ParallelConfig(zero_stage=3, sequence_parallel=sequence_parallel, schedule=schedule).validate()
    with pytest.raises(UserError, match=message):
        check_layout(tiny_model(), tiny_train(), mesh, parallel)


def test_an_unknown_zero_stage_is_refused():
    with pytest.raises(UserError, match="0, 1, 2 or 3"):
        ParallelConfig(zero_stage=4).validate()


def test_a_range_of_the_flat_buffer_falls_over_the_ranks_slices_exactly_once():
    """sharding.py's answer to "which part of [lo, hi) is rank r's, and where in its
    slice": the pieces tile the range in rank order, each where the rank's slice holds it."""
    from numpitron.distributed.sharding import balanced_bounds, piece_in_slice, pieces_of_range, shard_bounds
    rng = np.random.default_rng(0)
    for parts in (1, 2, 3, 4):
        size = parts * 7
        buffer = np.arange(size)
        slices = [buffer[slice(*shard_bounds(size, parts, r))] for r in range(parts)]
        for _ in range(50):
            lo, hi = sorted(rng.integers(0, size + 1, 2))
            counts = pieces_of_range(lo, hi, size, parts)
            pieces = [slices[r][piece_in_slice(lo, hi, size, parts, r)] for r in range(parts)]
            assert [len(p) for p in pieces] == counts
            assert np.array_equal(np.concatenate(pieces), buffer[lo:hi])
        # shares that need not be equal tile [0, n) and agree with the equal split when it divides
        for n in (0, 1, size - 1, size, size + 1):
            bounds = [balanced_bounds(n, parts, r) for r in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
        assert [balanced_bounds(size, parts, r) for r in range(parts)] == [shard_bounds(size, parts, r)
                                                                            for r in range(parts)]
