"""Every parallel layout trains exactly like one process (float64, rtol 1e-10).

Each test builds a mesh over the ranks mpi-pytest launched, trains 10 iterations,
and compares the losses (every rank) and the gathered full parameters (rank 0)
with a serial run of the same configuration computed inside the same rank.
"""

import numpy as np
import pytest

from tests.harness import check_mesh, make_trainer, mesh_id, run, serial_reference, tiny_model, tiny_train
from tests.tolerances import EQUIV_RTOL_FLOAT32, EQUIV_RTOL_FLOAT64, rel_diff


TWO_RANKS = [dict(data=2, bucket_size=2000), dict(tensor=2), dict(pipeline=2, schedule="gpipe"), dict(pipeline=2, schedule="1f1b"),
             dict(data=2, zero_stage=1), dict(data=2, overlap_grad_reduce=False, bucket_size=1000), dict(context=2),
             dict(tensor=2, sequence_parallel=True), dict(tensor=2, recompute="selective"),
             dict(tensor=2, recompute="full"), dict(tensor=2, sequence_parallel=True, recompute="selective"),
             dict(tensor=2, sequence_parallel=True, recompute="full"),
             dict(pipeline=2, schedule="interleaved", virtual_stages=2), dict(pipeline=2, schedule="zero-bubble"),
             dict(pipeline=2, schedule="zb-v"), dict(pipeline=2, schedule="dualpipev")]
# Interleaved and zero-bubble alone on four stages, and with tp, dp, ZeRO-1, cp,
# sequence parallelism and recomputation, pairwise.
FOUR_RANKS = [dict(data=4), dict(tensor=4), dict(tensor=2, data=2, bucket_size=1500), dict(pipeline=4, schedule="gpipe"),
              dict(pipeline=4, schedule="1f1b"), dict(tensor=2, pipeline=2), dict(data=4, zero_stage=1),
              dict(tensor=2, data=2, zero_stage=1), dict(pipeline=2, data=2, zero_stage=1),
              dict(context=4), dict(context=2, tensor=2), dict(context=2, data=2, bucket_size=3000),
              dict(context=2, pipeline=2, schedule="1f1b"), dict(context=2, data=2, zero_stage=1),
              dict(tensor=2, pipeline=2, sequence_parallel=True, recompute="full", schedule="1f1b"),
              dict(tensor=2, data=2, sequence_parallel=True, zero_stage=1, recompute="selective"),
              dict(tensor=2, context=2, sequence_parallel=True), dict(context=2, recompute="selective"),
              dict(pipeline=4, schedule="interleaved", virtual_stages=2, n_layers=8),
              dict(pipeline=4, schedule="zero-bubble"),
              dict(pipeline=2, tensor=2, schedule="zero-bubble", sequence_parallel=True),
              dict(pipeline=2, data=2, schedule="zero-bubble", zero_stage=1, recompute="full"),
              dict(pipeline=2, data=2, schedule="zero-bubble", bucket_size=2000),
              dict(pipeline=2, tensor=2, schedule="interleaved", virtual_stages=2, recompute="selective"),
              dict(pipeline=2, data=2, schedule="interleaved", virtual_stages=2, zero_stage=1),
              dict(pipeline=2, context=2, schedule="interleaved", virtual_stages=2, bucket_size=2000)]


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", TWO_RANKS, ids=mesh_id)
def test_two_ranks_match_serial(mesh):
    check_mesh(mesh)


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("mesh", FOUR_RANKS, ids=mesh_id)
def test_four_ranks_match_serial(mesh):
    check_mesh(mesh)


# The V schedules on four stages (m = 7, the fewest they run: 2p - 1) and with tp,
# sequence parallelism, recomputation, dp and ZeRO-1 and 2, pairwise.
V_MESHES = [(dict(pipeline=4, schedule="zb-v", n_layers=8), 14),
            (dict(pipeline=4, schedule="dualpipev", n_layers=8), 14),
            (dict(pipeline=2, tensor=2, schedule="zb-v", sequence_parallel=True), 8),
            (dict(pipeline=2, tensor=2, schedule="dualpipev", recompute="selective"), 8),
            (dict(pipeline=2, data=2, schedule="zb-v", zero_stage=2), 12),
            (dict(pipeline=2, data=2, schedule="dualpipev", zero_stage=1, bucket_size=2000), 12)]


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("mesh, global_batch", V_MESHES, ids=[mesh_id(mesh) for mesh, _ in V_MESHES])
def test_v_schedules_on_four_ranks_match_serial(mesh, global_batch):
    check_mesh(mesh, global_batch_size=global_batch)


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_a_v_on_one_process_hands_its_chunks_over_in_memory(schedule):
    """p = 1: both chunks on the one rank, every hand-over from chunk 0 to chunk 1 (and
    back) made in memory, none sent."""
    run = check_mesh(dict(schedule=schedule))
    assert run.trainer.topo.stats.calls.get("pp.send", 0) == 0


@pytest.mark.parallel(nprocs=8)
def test_full_3d_tp2_pp2_dp2_matches_serial():
    check_mesh(dict(tensor=2, pipeline=2, data=2, schedule="1f1b"))
    check_mesh(dict(tensor=2, pipeline=2, data=2, schedule="gpipe", zero_stage=1))
    check_mesh(dict(tensor=2, pipeline=2, data=2, sequence_parallel=True, recompute="selective"))


@pytest.mark.parallel(nprocs=2)
def test_float32_data_parallel_within_1e5():
    check_mesh(dict(data=2), dtype="float32", rtol=EQUIV_RTOL_FLOAT32)
    check_mesh(dict(data=2), dtype="float32", rtol=EQUIV_RTOL_FLOAT32, micro_batch_size=1)


@pytest.mark.parallel(nprocs=4)
def test_clipping_that_bites_stays_exact_under_zero1():
    # grad_clip far below the gradient norm: every step is clipped
    check_mesh(dict(tensor=2, data=2, zero_stage=1), grad_clip=0.05)
    check_mesh(dict(pipeline=2, data=2, zero_stage=1), grad_clip=0.05)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_on_one_process_is_bit_for_bit_the_same_run(recompute):
    model_cfg, train_cfg = tiny_model(), tiny_train()
    again, _, again_params, _ = run(make_trainer(model_cfg, train_cfg, recompute=recompute))
    plain, _, plain_params, _ = serial_reference(model_cfg, train_cfg)
    assert list(again) == list(plain)
    assert all(np.array_equal(again_params[k], plain_params[k]) for k in plain_params)


def test_gradient_accumulation_equals_one_big_batch():
    """micro-batch 2 x 6 accumulation steps == micro-batch 12 x 1 (serial)."""
    model_cfg = tiny_model()
    acc, _, acc_params, _ = serial_reference(model_cfg, tiny_train(micro_batch_size=2, global_batch_size=12))
    one, _, one_params, _ = serial_reference(model_cfg, tiny_train(micro_batch_size=12, global_batch_size=12))
    assert rel_diff(acc, one) <= EQUIV_RTOL_FLOAT64
    assert max(rel_diff(acc_params[k], one_params[k]) for k in one_params) <= EQUIV_RTOL_FLOAT64


@pytest.mark.parallel(nprocs=2)
def test_data_parallel_with_accumulation_equals_both():
    """dp=2 with 3 micro-batches of 2 each equals the serial batch of 12."""
    check_mesh(dict(data=2, bucket_size=3000), micro_batch_size=2, global_batch_size=12)
    check_mesh(dict(data=2), micro_batch_size=6, global_batch_size=12)
