"""Experts on split sequences: context parallelism (a rank holds T/cp of each sequence,
the ep group carved out of dp x cp) and sequence parallelism (a tp rank holds T/tp)
train exactly like one process (float64, rtol 1e-10, 10 iterations), with dropping,
with the aux loss and with bias balancing; pairwise with tp, pp, dp and ZeRO-3. The capacity's
queue, the aux loss and the load are those of the whole sequence; the all-to-alls carry
each rank's own tokens."""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.distributed.topology import Topology
from numpitron.context_parallel.zigzag import local_positions
from numpitron.experts.moe import MixtureOfExperts
from tests.harness import (assert_on_every_rank, gathered, check_mesh, identical_over, make_trainer, mesh_id, tiny_model,
                           tiny_train, train_steps)
from tests.layer_checks import make_store, moe_layer_traffic, rand_x
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

MOE = dict(num_experts=4, moe_top_k=2)
DROPPING = dict(moe_capacity_factor=1.0)
BIAS = dict(moe_load_balancing="bias", moe_bias_update_rate=0.01)

TWO_RANKS = [
    (dict(context=2, expert=2), DROPPING),                                   # ep x cp: ep spans the cp ranks
    (dict(context=2), BIAS),                                                  # cp, bias balancing
    (dict(context=2, context_parallel_type="ulysses"), dict(moe_shared_experts=1, **DROPPING)),
    (dict(tensor=2, sequence_parallel=True), DROPPING),                       # sp, aux loss
    (dict(tensor=2, sequence_parallel=True), dict(moe_shared_experts=1, **BIAS)),
    (dict(data=2, expert=2, zero_stage=3), DROPPING),                        # ZeRO-3: the experts at stage 2
]
FOUR_RANKS = [
    (dict(data=2, context=2, expert=4), DROPPING),                           # ep over dp x cp
    (dict(data=2, context=2, expert=2, zero_stage=1), BIAS),                  # expert_dp of 2, ZeRO-1
    (dict(pipeline=2, context=2, expert=2, schedule="1f1b"), DROPPING),
    (dict(tensor=2, data=2, expert=2, sequence_parallel=True), DROPPING),     # ep x sp
    (dict(pipeline=2, tensor=2, sequence_parallel=True, schedule="1f1b"), BIAS),
    (dict(tensor=2, context=2, expert=2, sequence_parallel=True), DROPPING),  # sp x cp x ep
    (dict(context=4, expert=4, context_parallel_type="hybrid", ulysses_size=2), DROPPING),
    (dict(tensor=2, context=2, expert=2, zero_stage=3), BIAS),
]


def case_id(case):
    return mesh_id({**case[0], **case[1]})


def check_split(mesh: dict, model: dict):
    """check_mesh with experts, and what every rank must share: the routing bias, the
    experts over their expert_dp replicas."""
    trainer = check_mesh(mesh, model={**MOE, **model}).trainer
    topo = trainer.topo
    assert_on_every_rank({
        "bias identical on every rank": identical_over(topo.world, trainer.model.experts.bias),
        "experts identical over expert_dp": identical_over(topo.expert_dp_comm, trainer.model.expert_store.data),
        # the ep group: ep consecutive ranks of dp x cp (dp_cp_rank = dp_rank * cp + cp_rank)
        "ep": (gathered(topo.ep_comm, topo.dp_cp_rank),
               [topo.dp_cp_rank // topo.ep * topo.ep + e for e in range(topo.ep)]),
    })
    return trainer


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("case", TWO_RANKS, ids=case_id)
def test_two_ranks_match_serial(case):
    trainer = check_split(*case)
    if case[1] is DROPPING:       # the capacity did drop: the queue was the whole sequence's
        assert trainer.train_step(np.random.default_rng(0).integers(0, 65, 6000).astype(np.uint16))[
            "moe_dropped_fraction"] > 0


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("case", FOUR_RANKS, ids=case_id)
def test_four_ranks_match_serial(case):
    check_split(*case)


@pytest.mark.parallel(nprocs=2)
def test_all_to_all_bytes_on_context_parallel_ranks():
    """ep = cp = 2: each rank routes and sends only its own T/cp tokens of each sequence.
    The experts' all-to-alls move 2 (S + R) C b bytes as on dp; cp adds one all-gather of
    the choices (B T k integers per rank in all) and one all-reduce of B x E sums."""
    topo = Topology.from_world(context=2, expert=2)
    B, T, C, E, k = 2, 16, 8, 4, 2
    layer = MixtureOfExperts("mlp", C, topo, 0.3, num_experts=E, top_k=k, capacity_factor=1.0, aux_loss_coef=0.01)
    make_store(layer.parameters())
    whole = rand_x((B, T, C))                                   # the same sequences on both ranks
    x = np.ascontiguousarray(whole[:, local_positions(T, 2, topo.cp_rank)])
    sent, received, routing, snap = moe_layer_traffic(layer, x, rand_x(x.shape, seed=9), E)
    assert_on_every_rank({
        "all_to_allv bytes": (snap["ep.all_to_allv"]["bytes"], 2 * (sent + received) * C * 8),
        "counts exchanged once": (snap["ep.all_to_all"]["bytes"], (2 - 1) / 2 * E * 8),
        "choices gathered over cp": (snap["cp.all_gather"]["bytes"], (2 - 1) / 2 * B * T * k * 8),
        "probabilities summed over cp": (snap["cp.all_reduce"]["bytes"], 2 * (2 - 1) / 2 * B * E * 8),
        "something dropped and something sent": (MPI.COMM_WORLD.allreduce(int(np.sum(~routing.kept))) > 0
                                                 and sent > 0, True),
        "only ep and cp talk": (sorted(snap), ["cp.all_gather", "cp.all_reduce", "ep.all_to_all", "ep.all_to_allv"]),
    })


@pytest.mark.parallel(nprocs=2)
def test_a_checkpoint_from_cp_and_ep_resumes_on_sp(shared_dir):
    """Saved on cp = ep = 2 (ZeRO-3, bias balancing, dropping), resumed on tp = 2 with sp:
    the experts by global index, the bias from the manifest, and the run goes on like an
    uninterrupted one process."""
    model_cfg, train_cfg = tiny_model(n_layers=2, n_heads=2, **MOE, **DROPPING, **BIAS), tiny_train()
    tokens = np.random.default_rng(0).integers(0, 65, 5000).astype(np.uint16)
    expected = train_steps(make_trainer(model_cfg, train_cfg, Topology.serial()), 6, tokens)
    source = make_trainer(model_cfg, train_cfg, context=2, expert=2, zero_stage=3)
    assert rel_diff(train_steps(source, 3, tokens), expected[:3]) <= EQUIV_RTOL_FLOAT64
    path = save_checkpoint(shared_dir / "from-cp-ep", source)
    resumed = make_trainer(model_cfg, train_cfg, tensor=2, sequence_parallel=True)
    load_checkpoint(path, resumed)
    assert np.array_equal(resumed.model.experts.bias, source.model.experts.bias)
    assert rel_diff(train_steps(resumed, 3, tokens), expected[3:]) <= EQUIV_RTOL_FLOAT64
