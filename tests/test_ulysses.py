"""Ulysses and hybrid context parallelism (context_parallel/ulysses.py): where a group's chunks
land, the sub-groups of cp, float64 equivalence with one process, the all-to-all and
ring bytes against docs/12-context-parallelism.md's formulas, and bad flags. (The ring alone is in
test_context_parallel.py and test_equivalence.py.)"""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.config import ParallelConfig
from numpitron.layout import check_layout
from numpitron.distributed.topology import Mesh, Topology
from numpitron.errors import UserError
from numpitron.context_parallel.zigzag import local_positions, zigzag_chunks
from numpitron.context_parallel.ulysses import group_rows
from tests.harness import assert_on_every_rank, check_mesh, error_lines, make_trainer, mesh_id, run_script, tiny_model
from tests.harness import tiny_tokens, tiny_train


@pytest.mark.parametrize("cp, ulysses", [(2, 2), (4, 2), (4, 4), (8, 2), (8, 4)])
def test_a_ulysses_group_holds_the_zigzag_part_of_its_ring_rank(cp, ulysses):
    """After the all-to-all, group g's rows hold exactly the positions of chunks g and
    2R-1-g of the sequence split over R = cp/U ring ranks, in position order."""
    seq, t = 32, 32 // cp
    for group in range(cp // ulysses):
        rows = np.full(ulysses * t, -1)
        for member, mine, theirs in group_rows(t, cp, ulysses, group * ulysses):
            rows[theirs] = local_positions(seq, cp, group * ulysses + member)[mine]
        ring = zigzag_chunks(ulysses * t, cp // ulysses, group)
        expected = np.concatenate([np.arange(c.position, c.last_position + 1) for c in ring])
        assert list(rows) == list(expected)


def members(comm):
    return comm.mpi.allgather(MPI.COMM_WORLD.Get_rank())


@pytest.mark.parallel(nprocs=4)
def test_hybrid_groups_are_consecutive_cp_ranks_and_the_ring_joins_equal_places():
    topo = Topology.from_world(context=4, ulysses=2)
    c = topo.cp_rank
    group, place = divmod(c, 2)
    assert_on_every_rank({
        "ulysses group": members(topo.cp_ulysses_comm) == [group * 2, group * 2 + 1],
        "ring": members(topo.cp_ring_comm) == [place, place + 2],
        "ranks": (topo.cp_ulysses_comm.rank, topo.cp_ring_comm.rank) == (place, group),
        "printout": "all-to-all in groups of 2, ring over 2" in str(topo)})


def test_serial_topology_has_both_cp_sub_groups():
    topo = Topology.serial()
    assert (topo.cp_ulysses_comm.size, topo.cp_ring_comm.size) == (1, 1)


# Each type at cp = 2 and 4; with tp (heads split by tp, then by Ulysses), sequence
# parallelism, dp with ZeRO-1, pp, and recomputation, pairwise.
MESHES = [dict(context=4, context_parallel_type="ulysses"),
          dict(context=4, context_parallel_type="hybrid", ulysses_size=2),
          dict(context=2, tensor=2, context_parallel_type="ulysses", sequence_parallel=True),
          dict(context=2, tensor=2, context_parallel_type="hybrid", ulysses_size=2, recompute="selective"),
          dict(context=2, data=2, context_parallel_type="ulysses", zero_stage=1, recompute="selective"),
          dict(context=2, pipeline=2, context_parallel_type="ulysses", recompute="full")]


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("mesh", MESHES, ids=mesh_id)
def test_four_ranks_match_serial(mesh):
    check_mesh(mesh)


def expected_cp_bytes(model_cfg, train_cfg, microbatches, tp, cp, ulysses) -> dict:
    """docs/12-context-parallelism.md: per layer and micro-batch, with t = T/cp tokens and a block of
    B t C/tp values, the all-to-alls send (U-1)/U of q, k, v, the output, dO, dQ, dK,
    dV (8 blocks) and D (one value per token and local head); the ring over R = cp/U
    sends 4(R-1) + 2R blocks. Each rank receives what it sends."""
    B, C, H, item = train_cfg.micro_batch_size, model_cfg.d_model, model_cfg.n_heads, 8
    t, ring = model_cfg.seq_len // cp, cp // ulysses
    times = microbatches * model_cfg.n_layers
    block = B * t * C // tp * item
    out = {"all_to_all": times * (ulysses - 1) / ulysses * (8 * block + B * t * H // tp * item),
           "all_to_all calls": times * 5 if ulysses > 1 else 0,
           "send": times * (4 * (ring - 1) + 2 * ring) * block if ring > 1 else 0}
    return out


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("mesh", [dict(context=4, context_parallel_type="hybrid", ulysses_size=2),
                                  dict(context=2, tensor=2, context_parallel_type="ulysses")], ids=mesh_id)
def test_all_to_all_and_ring_bytes_match_the_formula(mesh):
    model_cfg, train_cfg = tiny_model(), tiny_train()
    trainer = make_trainer(model_cfg, train_cfg, **mesh)
    topo = trainer.topo
    topo.stats.reset()
    trainer.train_step(tiny_tokens())
    snap = topo.stats.snapshot()
    got = lambda kind, field="bytes": snap.get(f"cp.{kind}", {}).get(field, 0)    # noqa: E731
    expected = expected_cp_bytes(model_cfg, train_cfg, trainer.num_microbatches, topo.tp, topo.cp, topo.ulysses)
    assert_on_every_rank({"all_to_all": (got("all_to_all"), expected["all_to_all"]),
                          "all_to_all calls": (got("all_to_all", "calls"), expected["all_to_all calls"]),
                          "send": (got("send"), expected["send"]), "recv": (got("recv"), expected["send"])})


@pytest.mark.parametrize("model, mesh, parallel, message", [
    (dict(n_heads=2), Mesh(1, 1, 1, 4), dict(context_parallel_type="ulysses"),
     "n_heads / tensor-parallel size (2 / 1 = 2) must be divisible by the context-parallel size (4)"),
    (dict(), Mesh(2, 1, 1, 4), dict(context_parallel_type="hybrid", ulysses_size=4),
     "n_heads / tensor-parallel size (4 / 2 = 2) must be divisible by the --ulysses-size (4)"),
    (dict(), Mesh(1, 1, 1, 4), dict(context_parallel_type="hybrid", ulysses_size=3),
     "--ulysses-size (3) must divide the context-parallel size (4)"),
])
def test_layouts_ulysses_cannot_split_are_refused(model, mesh, parallel, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(tiny_model(**model), None, mesh, ParallelConfig(**parallel).validate())


@pytest.mark.parametrize("parallel, message", [
    (dict(context_parallel_type="hybrid"), "--context-parallel-type hybrid and --ulysses-size go together"),
    (dict(ulysses_size=2), "--context-parallel-type hybrid and --ulysses-size go together"),
    (dict(context_parallel_type="a2a"), "unknown context-parallel type 'a2a'"),
])
def test_bad_context_parallel_types_are_refused(parallel, message):
    with pytest.raises(UserError, match=message):
        ParallelConfig(**parallel).validate()


def test_too_few_heads_for_ulysses_is_one_line_from_one_rank():

    result = run_script(["--context-parallel-size", "2", "--context-parallel-type", "ulysses", "--n-heads", "1",
                  "--max-iters", "1", "--no-progress"], nprocs=2, timeout=60)
    lines = error_lines(result.stderr)
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "must be divisible by the context-parallel size (2)" in lines[0]
