"""Muon on a mesh: every layout trains like one process (float64, 10 iterations, 1e-10),
the owners' gathers and scatters move the bytes of the formula in
muon/owners.py (docs/10-muon.md), and a Muon checkpoint resumes on any mesh."""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.distributed.sharding import pieces_of_range
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.plan.accounting import Rank
from numpitron.plan.layer_sizes import stage_matrices
from numpitron.plan.muon_cost import muon_cost, newton_schulz_work
from tests.harness import (SMALLER, assert_on_every_rank, check_mesh, make_trainer, mesh_id, tiny_model, tiny_train,
                           tiny_tokens, train_steps)
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

TWO_RANKS = [dict(data=2), dict(tensor=2), dict(pipeline=2, schedule="1f1b"), dict(data=2, zero_stage=1),
             dict(data=2, zero_stage=2), dict(data=2, zero_stage=3), dict(context=2, zero_stage=1)]
# Both axes of the gather at once, pairwise with the other strategies.
FOUR_RANKS = [dict(tensor=2, data=2, zero_stage=1), dict(tensor=2, data=2, zero_stage=3),
              dict(tensor=2, pipeline=2, schedule="1f1b"), dict(pipeline=2, data=2, zero_stage=1, schedule="gpipe"),
              dict(tensor=2, data=2, sequence_parallel=True, zero_stage=2)]


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", TWO_RANKS, ids=mesh_id)
def test_muon_on_two_ranks_matches_one_process(mesh):
    check_mesh(mesh, optimizer="muon")


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("mesh", FOUR_RANKS, ids=mesh_id)
def test_muon_on_four_ranks_matches_one_process(mesh):
    check_mesh(mesh, optimizer="muon")


@pytest.mark.parallel(nprocs=2)
def test_muon_with_experts_matches_one_process():
    """The experts' matrices too, their owners over tp x the experts' own ZeRO group."""
    check_mesh(dict(data=2, expert=2, zero_stage=1), model=dict(num_experts=2, moe_top_k=1), optimizer="muon")


def muon_bytes(trainer) -> float:
    """The formula of muon/owners.py for one store, summed over its ranks:
    2 b sum_k [(E_k - tp c_k) + E_k (tp - 1) / tp]."""
    owners, tp = trainer.optimizer.adam.orthogonalise, trainer.topo.tp
    total = 0
    for piece, (_, d) in zip(owners.pieces, owners.owner):
        E = int(np.prod(piece.shape))
        c = pieces_of_range(piece.a, piece.b, owners.size, owners.shards.size)[d]
        total += (E - tp * c) + E * (tp - 1) // tp
    return 2 * trainer.model.store.dtype.itemsize * total


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("layout", [dict(tensor=2, data=2, zero_stage=0), dict(tensor=2, data=2, zero_stage=1),
                                    dict(tensor=2, data=2, zero_stage=3), dict(data=4, data_shard=2, zero_stage=1)],
                         ids=mesh_id)
def test_the_owners_move_the_bytes_of_the_formula_and_of_the_planner(layout):
    """Summed over the world: the formula, once per replica (without ZeRO each dp replica
    of tp ranks orthogonalises for itself, c_k = E_k / tp; under HSDP each replica's S
    ranks). On every rank: the planner's bytes per kind (plan/muon_cost.py)."""
    trainer = make_trainer(tiny_model(), tiny_train(optimizer="muon"), **layout)
    trainer.train_step(tiny_tokens())           # the first step allocates what ZeRO-3 gathers
    trainer.topo.stats.reset()
    trainer.train_step(tiny_tokens())
    moved = {kind: trainer.topo.stats.bytes[kind] for comm in ("tp", "dp_shard", "dp_cp", "dp_replica")
             for kind in (f"{comm}.gather", f"{comm}.scatter") if trainer.topo.stats.bytes[kind]}
    owners = trainer.optimizer.adam.orthogonalise
    expected = muon_bytes(trainer) * (trainer.topo.dp_cp // owners.shards.size)
    planned = muon_cost(trainer.model_cfg, trainer.parallel_cfg, Rank.of(trainer.topo, trainer.parallel_cfg))
    assert_on_every_rank({"formula": (MPI.COMM_WORLD.allreduce(sum(moved.values())), expected),
                          "planner": (moved, planned["comm_bytes"]), "moves some": expected > 0})


def test_the_planner_counts_newton_schulz_flops_by_the_formula():
    """A block's four matrices are C x 3C, C x C, C x 4C and 4C x C: with m = C, five
    steps of 4 m^2 n + 2 m^3 FLOPs give 5 (14 + 6 + 18 + 18) C^3 = 280 C^3 a block
    (docs/10-muon.md); the owners split them, and the priced BLAS calls count as many."""
    from numpitron.config import ModelConfig, ParallelConfig
    for model, layout in ((tiny_model(), dict(tp=1, dp=1)), (ModelConfig().validate(), dict(tp=1, dp=2)),
                          (tiny_model(n_layers=3), dict(tp=2, dp=2))):
        rank = Rank(layout["tp"], 1, layout["dp"], 1)
        cost = muon_cost(model, ParallelConfig(zero_stage=1), rank)
        formula = 280 * model.d_model ** 3 * model.n_layers
        shapes = [shape for _, _, shape in stage_matrices(model, rank)]
        assert cost["flops_total"] == sum(cost["owner_flops"]) == formula == newton_schulz_work(shapes).flops
        assert len(cost["owner_flops"]) == layout["tp"] * layout["dp"]
        assert cost["imbalance"] == max(cost["owner_flops"]) / (formula / len(cost["owner_flops"])) >= 1
    assert 280 * 128 ** 3 * 4 == 2_348_810_240                      # the default model: 2.35 GFLOP a step


MODEL = tiny_model(**SMALLER)


def train_cfg():
    return tiny_train(optimizer="muon", micro_batch_size=2, global_batch_size=4, seed=1)


@pytest.mark.parallel(nprocs=2)
def test_a_muon_checkpoint_resumes_on_other_meshes(shared_dir):
    """dp = 2 ZeRO-1 saves (each rank half of the momentum); tp = 2 and ZeRO-3 resume it,
    and one process resumes ZeRO-3's: one uninterrupted serial trajectory."""
    expected = train_steps(make_trainer(MODEL, train_cfg(), Topology.serial()), 9, tiny_tokens())
    source = make_trainer(MODEL, train_cfg(), data=2, zero_stage=1)
    train_steps(source, 3, tiny_tokens())
    path = save_checkpoint(shared_dir / "zero1", source)
    tp = make_trainer(MODEL, train_cfg(), tensor=2)
    load_checkpoint(path, tp)
    assert rel_diff(train_steps(tp, 3, tiny_tokens()), expected[3:6]) <= EQUIV_RTOL_FLOAT64
    zero3 = make_trainer(MODEL, train_cfg(), data=2, zero_stage=3)
    load_checkpoint(path, zero3)
    assert rel_diff(train_steps(zero3, 3, tiny_tokens()), expected[3:6]) <= EQUIV_RTOL_FLOAT64
    path = save_checkpoint(shared_dir / "zero3", zero3)
    one = make_trainer(MODEL, train_cfg(), Topology.serial())
    load_checkpoint(path, one)
    assert one.optimizer.adam.momentum.any()
    assert rel_diff(train_steps(one, 3, tiny_tokens()), expected[6:]) <= EQUIV_RTOL_FLOAT64


@pytest.mark.parallel(nprocs=2)
def test_a_checkpoint_resumes_only_with_its_own_optimizer(shared_dir):
    adamw = make_trainer(MODEL, tiny_train(micro_batch_size=2, global_batch_size=4), data=2)
    train_steps(adamw, 1, tiny_tokens())
    path = save_checkpoint(shared_dir, adamw)
    muon = make_trainer(MODEL, train_cfg(), data=2)
    with pytest.raises(UserError, match="holds the state of --optimizer adamw; resume it with --optimizer adamw"):
        load_checkpoint(path, muon)


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("layout", [dict(), dict(data=2), dict(data=2, zero_stage=1), dict(data=2, zero_stage=3),
                                    dict(pipeline=2), dict(tensor=2, zero_stage=2)], ids=mesh_id)
def test_the_planner_counts_muons_state_to_the_byte(layout):
    """One moment on the matrices' elements of a rank's slice, two on the rest."""
    from numpitron.optim.memory_report import memory_bytes
    from numpitron.plan.accounting import state_bytes
    trainer = make_trainer(tiny_model(), tiny_train(optimizer="muon"), **layout)
    trainer.train_step(tiny_tokens())           # ZeRO-3's peaks are those of a step
    topo = trainer.topo
    rank = Rank(topo.tp, topo.pp, topo.dp, topo.cp, topo.pp_rank, topo.cp_rank, topo.dp_rank)
    measured, planned = memory_bytes(trainer.optimizer), state_bytes(trainer.model_cfg, trainer.parallel_cfg, rank, "muon")
    adamw = state_bytes(trainer.model_cfg, trainer.parallel_cfg, rank)["optimizer_state"]
    assert_on_every_rank({"memory": (measured, planned), "fewer than AdamW": planned["optimizer_state"] < adamw})
