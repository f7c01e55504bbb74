"""The process mesh and the byte-counting collectives.

Expected group members follow from the layout rule of docs/architecture.md alone,
rank = (pp * dp_size + dp) * tp_size + tp; expected byte counts from the ring
formulas (all-reduce 2(k-1)/k of the buffer, reduce-scatter and all-gather (k-1)/k
of the full buffer, point-to-point the buffer). Multi-rank tests gather every
verdict before asserting, so one failing rank never leaves the others hanging.
"""

import re
import socket

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.distributed.comm import Comm, CommStats
from numpitron.distributed.groups import GROUPS, axis_sizes, partition
from numpitron.distributed.topology import Topology, resolve_mesh
from numpitron.errors import UserError
from tests.harness import assert_on_every_rank, gathered





def test_serial_topology_sizes_and_no_op_collectives():
    topo = Topology.serial()
    assert (topo.tp, topo.pp, topo.dp, topo.world_size, topo.rank) == (1, 1, 1, 1, 0)
    assert (topo.tp_rank, topo.pp_rank, topo.dp_rank) == (0, 0, 0)
    assert topo.is_first_stage and topo.is_last_stage and topo.is_logger
    assert topo.prev_stage is None and topo.next_stage is None
    comms = [topo.world, topo.tp_comm, topo.dp_comm, topo.pp_comm, topo.model_comm, topo.embedding_comm]
    for comm in comms:
        assert (comm.size, comm.rank) == (1, 0)
        buf = np.arange(6.0)
        assert comm.all_reduce(buf) is buf and np.array_equal(buf, np.arange(6.0))
        assert np.array_equal(comm.all_reduce(buf, op="max"), np.arange(6.0))
        shard = np.zeros(6)
        assert np.array_equal(comm.reduce_scatter(buf, shard), buf)
        assert np.array_equal(comm.all_gather(buf), np.arange(6.0))
        assert np.array_equal(comm.broadcast(buf), np.arange(6.0))
        full = np.zeros(6)
        assert np.array_equal(comm.gather(buf, full), buf)
        assert comm.broadcast_object({"a": 1}) == {"a": 1} and comm.all_reduce_object_max(3) == 3
        comm.barrier()
    assert topo.stats.total_bytes() == 0 and topo.stats.snapshot() == {}


def test_resolve_mesh_derives_data_parallel_size():
    assert resolve_mesh(8, 2, 2, None) == (2, 2, 2, 1, 1, 2)
    assert resolve_mesh(8, 2, 1, None) == (2, 1, 4, 1, 1, 4)
    assert resolve_mesh(6, 1, 3, 2) == (1, 3, 2, 1, 1, 2)
    assert resolve_mesh(1, 1, 1, None) == (1, 1, 1, 1, 1, 1)
    assert resolve_mesh(16, 2, 2, None, 2) == (2, 2, 2, 2, 1, 2)
    assert resolve_mesh(8, 1, 1, None, data_shard=2) == (1, 1, 8, 1, 1, 2)       # HSDP: S = 2 of dp = 8


@pytest.mark.parametrize("world, tp, pp, dp, message", [
    (6, 4, 1, None, "world size 6 is not divisible by tensor x context x pipeline parallel size (4 x 1 x 1 = 4)"),
    (8, 2, 2, 4, "(2 x 1 x 2 x 4 = 16) does not match the world size 8"),
    (8, 2, 2, 1, "(2 x 1 x 2 x 1 = 4) does not match the world size 8"),
    (4, 0, 1, None, "tensor-parallel size must be positive, got 0"),
    (4, 1, 1, -2, "data-parallel size must be positive, got -2"),
])
def test_resolve_mesh_rejects_mismatches(world, tp, pp, dp, message):
    with pytest.raises(UserError) as info:
        resolve_mesh(world, tp, pp, dp)
    assert message in str(info.value)


def members(comm):
    return gathered(comm, MPI.COMM_WORLD.Get_rank())


@pytest.mark.parallel(nprocs=8)
def test_three_d_mesh_layout_and_groups():
    topo = Topology.from_world(tensor=2, pipeline=2, data=2)
    tp_, dp_, pp_ = topo.tp, topo.dp, topo.pp
    r, p, d, t = topo.rank, topo.pp_rank, topo.dp_rank, topo.tp_rank
    at = lambda s, dd, tt: (s * dp_ + dd) * tp_ + tt          # noqa: E731  (docs/architecture.md)
    flags = {
        "sizes": (tp_, pp_, dp_, topo.world_size) == (2, 2, 2, 8),
        "rank formula": r == MPI.COMM_WORLD.Get_rank() == at(p, d, t) == topo.world_rank_of(p, d, t),
        "tp group": members(topo.tp_comm) == [at(p, d, x) for x in range(tp_)],
        "dp group": members(topo.dp_comm) == [at(p, x, t) for x in range(dp_)],
        "pp group": members(topo.pp_comm) == [at(x, d, t) for x in range(pp_)],
        "model group": sorted(members(topo.model_comm)) == sorted(at(s, d, x) for s in range(pp_) for x in range(tp_)),
        "embedding group": sorted(members(topo.embedding_comm)) == [at(0, d, t), at(pp_ - 1, d, t)],
        "comm ranks": (topo.tp_comm.rank, topo.dp_comm.rank, topo.pp_comm.rank) == (t, d, p),
        "stage neighbours": (topo.prev_stage, topo.next_stage) == ((None, 1) if p == 0 else (0, None)),
    }
    # every pp_rank/dp_rank/tp_rank triple occurs exactly once in the world
    flags["coordinates unique"] = len(set(MPI.COMM_WORLD.allgather((p, d, t)))) == 8
    lines = str(topo).splitlines()
    stage_lines = [line for line in lines if line.strip().startswith("stage")]
    flags["one line per stage"] = len(stage_lines) == pp_
    for s, line in enumerate(stage_lines):
        listed = [int(x) for x in re.findall(r"\d+", line.split(":", 1)[1])]
        flags[f"stage {s} ranks"] = sorted(listed) == [at(s, dd, tt) for dd in range(dp_) for tt in range(tp_)]
    assert_on_every_rank(flags)


@pytest.mark.parallel(nprocs=8)
@pytest.mark.parametrize("sizes", [dict(tensor=2, context=2, data=2), dict(context=2, data=2, pipeline=2)],
                         ids=["tp2-cp2-dp2", "cp2-dp2-pp2"])
def test_four_d_mesh_with_context_parallel_groups(sizes):
    topo = Topology.from_world(**sizes)
    T, K, D, P = topo.tp, topo.cp, topo.dp, topo.pp
    p, d, c, t = topo.pp_rank, topo.dp_rank, topo.cp_rank, topo.tp_rank
    at = lambda s, dd, cc, tt: ((s * D + dd) * K + cc) * T + tt          # noqa: E731  (docs/architecture.md)
    flags = {
        "rank formula": topo.rank == at(p, d, c, t) == topo.world_rank_of(p, d, t, c),
        "tp group": members(topo.tp_comm) == [at(p, d, c, x) for x in range(T)],
        "cp group": members(topo.cp_comm) == [at(p, d, x, t) for x in range(K)],
        "dp group": members(topo.dp_comm) == [at(p, x, c, t) for x in range(D)],
        "dp_cp group": members(topo.dp_cp_comm) == [at(p, x, y, t) for x in range(D) for y in range(K)],
        "dp_cp rank": topo.dp_cp_comm.rank == topo.dp_cp_rank == d * K + c,
        "pp group": members(topo.pp_comm) == [at(x, d, c, t) for x in range(P)],
        "model group": sorted(members(topo.model_comm)) == sorted(at(s, d, c, x) for s in range(P) for x in range(T)),
        "printout lists every rank once": sorted(int(x) for line in str(topo).splitlines()
                                                 if line.startswith("  stage") for x in re.findall(r"\b\d+\b", line.split(":", 1)[1]))
                                          == list(range(8)),
        "printout names every rank's host": str(topo).splitlines()[-1]
        == f"  hosts: {socket.gethostname()} [{' '.join(map(str, range(8)))}]",
    }
    assert_on_every_rank(flags)


@pytest.mark.parallel(nprocs=4)
def test_pipeline_of_four_has_embedding_group_on_the_ends_only():
    topo = Topology.from_world(pipeline=4)
    ends = topo.pp_rank in (0, 3)
    flags = {"dp derived": (topo.tp, topo.pp, topo.dp) == (1, 4, 1),
             "embedding": (members(topo.embedding_comm) == [0, 3]) if ends else
                          (topo.embedding_comm.mpi is None and topo.embedding_comm.size == 1)}
    assert_on_every_rank(flags)


def check_collectives(comm, stats, dtype, n=24):
    """Run every collective on `comm` (fresh stats) and return {check: ok}."""
    k, me, item = comm.size, comm.rank, np.dtype(dtype).itemsize
    flags, f = {}, np.dtype(dtype).name
    inputs = [np.arange(n, dtype=dtype) * (r + 1) + r for r in range(k)]   # rank r's buffer

    stats.reset()
    buf = inputs[me].copy()
    comm.all_reduce(buf)
    flags[f"all_reduce sum {f}"] = np.array_equal(buf, sum(inputs))
    flags[f"all_reduce bytes {f}"] = stats.bytes[f"{comm.name}.all_reduce"] == 2 * (k - 1) / k * item * n
    flags[f"all_reduce calls {f}"] = stats.calls[f"{comm.name}.all_reduce"] == 1
    ar_bytes = stats.bytes[f"{comm.name}.all_reduce"]
    top = np.full(3, float(me), dtype)
    flags[f"all_reduce max {f}"] = np.all(comm.all_reduce(top, op="max") == k - 1)

    stats.reset()
    shard = np.empty(n // k, dtype)
    comm.reduce_scatter(inputs[me].copy(), shard)
    flags[f"reduce_scatter values {f}"] = np.array_equal(shard, sum(inputs)[me * n // k:(me + 1) * n // k])
    rs_bytes = stats.bytes[f"{comm.name}.reduce_scatter"]
    flags[f"reduce_scatter bytes {f}"] = rs_bytes == (k - 1) / k * item * n

    full = np.zeros(n, dtype)
    full[me * n // k:(me + 1) * n // k] = inputs[me][me * n // k:(me + 1) * n // k]
    comm.all_gather(full)
    expected = np.concatenate([inputs[r][r * n // k:(r + 1) * n // k] for r in range(k)])
    flags[f"all_gather values {f}"] = np.array_equal(full, expected)
    ag_bytes = stats.bytes[f"{comm.name}.all_gather"]
    flags[f"all_gather bytes {f}"] = ag_bytes == (k - 1) / k * item * n
    flags[f"rs + ag == ar {f}"] = rs_bytes + ag_bytes == ar_bytes

    stats.reset()                          # pairs (0,1), (2,3): blocking, then non-blocking
    peer = me ^ 1
    got = np.empty(n, dtype)
    if me % 2 == 0:
        comm.send(inputs[me], peer, tag=5)
        comm.recv(got, peer, tag=6)
    else:
        comm.recv(got, peer, tag=5)
        comm.send(inputs[me], peer, tag=6)
    flags[f"send/recv data {f}"] = np.array_equal(got, inputs[peer])
    got2 = np.empty(n, dtype)
    pending = comm.isend(inputs[me], peer, tag=7)
    comm.recv(got2, peer, tag=7)
    comm.wait_all([pending])
    flags[f"isend/recv data {f}"] = np.array_equal(got2, inputs[peer])
    flags[f"p2p bytes {f}"] = (stats.bytes[f"{comm.name}.send"], stats.bytes[f"{comm.name}.recv"],
                               stats.calls[f"{comm.name}.send"]) == (2 * item * n, 2 * item * n, 2)
    comm.wait_all([])
    return flags


@pytest.mark.parallel(nprocs=4)
def test_collectives_move_and_count_the_right_bytes():
    flags = {}
    world = Comm(MPI.COMM_WORLD, CommStats(), "w")                 # a group of 4
    topo = Topology.from_world(tensor=2, data=2)                   # groups of 2
    for dtype in (np.float32, np.float64):
        flags.update({f"k=4 {key}": ok for key, ok in check_collectives(world, world.stats, dtype).items()})
        flags.update({f"k=2 {key}": ok for key, ok in check_collectives(topo.tp_comm, topo.stats, dtype).items()})
    # counters from different comms of one topology land under separate keys
    topo.stats.reset()
    topo.dp_comm.all_reduce(np.ones(4))
    topo.tp_comm.all_reduce(np.ones(8, np.float32))
    snap = topo.stats.snapshot()
    flags["keys"] = {k: (v["bytes"], v["calls"]) for k, v in snap.items()} == {
        "dp.all_reduce": (2 * (1 / 2) * 4 * 8, 1), "tp.all_reduce": (2 * (1 / 2) * 8 * 4, 1)}
    flags["seconds counted"] = all(v["seconds"] > 0 for v in snap.values())
    assert_on_every_rank(flags)


@pytest.mark.parallel(nprocs=2)
def test_a_started_collective_keeps_the_buffers_it_was_given_until_waited_for():
    # mpi4py's request holds no reference: a temporary handed to a non-blocking call
    # (a transposed copy, a wire format's cast) must live in the Pending until `wait`.
    import weakref
    comm, flags, n = Comm(MPI.COMM_WORLD, CommStats(), "w"), {}, 1 << 17
    for wire in (None, np.dtype("float32")):
        mine = np.empty(n)
        full = np.full(2 * n, 1.0 + comm.rank)
        alive = weakref.ref(full)
        pending = comm.ireduce_scatter(full, mine, [n, n], wire)
        del full
        flags[f"reduce_scatter {wire}: kept"] = alive() is not None
        np.full(2 * n, -7.0)                           # what a freed buffer's memory would get
        comm.wait(pending)
        flags[f"reduce_scatter {wire}: sum"] = bool(np.all(mine == 3.0))
        flags[f"reduce_scatter {wire}: released"] = alive() is None
        whole = np.empty(2 * n)
        piece = np.full(n, 1.0 + comm.rank)
        alive = weakref.ref(piece)
        pending = comm.iall_gather(piece, whole, [n, n], wire)
        del piece
        flags[f"all_gather {wire}: kept"] = alive() is not None
        comm.wait(pending)
        flags[f"all_gather {wire}: values"] = bool(np.all(whole == np.repeat([1.0, 2.0], n)))
    assert_on_every_rank(flags)


def test_every_group_of_the_table_partitions_the_world_as_the_rank_formula_says():
    """distributed/groups.py: each group's ranks, from the table of axes, are the ranks
    that share every coordinate but the group's own (pp 2, dp 4, cp 2, tp 2; S = 2,
    U = 2, ep = 4), checked against the rank formula, without MPI."""
    tp, pp, dp, cp, ep, U, S = 2, 2, 4, 2, 4, 2, 2
    sizes = axis_sizes(tp, pp, dp, cp, ep, U, S)
    at = lambda s, d, c, t: ((s * dp + d) * cp + c) * tp + t          # noqa: E731
    coords = {at(s, d, c, t): (s, d, c, t) for s in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)}
    same = {  # what the members of one group share
        "tp": lambda s, d, c, t: (s, d, c), "cp": lambda s, d, c, t: (s, d, t), "dp": lambda s, d, c, t: (s, c, t),
        "dp_cp": lambda s, d, c, t: (s, t), "pp": lambda s, d, c, t: (d, c, t), "model": lambda s, d, c, t: (d, c),
        "cp_ulysses": lambda s, d, c, t: (s, d, c // U, t), "cp_ring": lambda s, d, c, t: (s, d, c % U, t),
        "ep": lambda s, d, c, t: (s, (d * cp + c) // ep, t), "expert_dp": lambda s, d, c, t: (s, (d * cp + c) % ep, t),
        "expert_model": lambda s, d, c, t: ((d * cp + c) // ep,), "dp_shard": lambda s, d, c, t: (s, d // S, t),
        "dp_replica": lambda s, d, c, t: (s, d % S, c, t), "dp_shard_model": lambda s, d, c, t: (d // S,),
        "expert_dp_shard": lambda s, d, c, t: (s, d // S, (d * cp + c) % ep, t)}
    assert set(same) == set(GROUPS)
    for name, shared in same.items():
        rows = partition(name, sizes)
        expected = {}
        for rank, c in sorted(coords.items()):
            expected.setdefault(shared(*c), []).append(rank)
        assert sorted(map(list, rows)) == sorted(expected.values()), name


@pytest.mark.parallel(nprocs=4)
def test_a_feature_that_is_off_makes_no_communicator_of_its_own():
    """dp = 4 alone: the groups of features that are off hold one rank (no MPI
    communicator) or the same ranks as a group made already (its communicator); with
    hybrid sharding (S = 2) and ep = 2 their own groups appear."""
    plain = Topology.from_world(data=4)
    hybrid = Topology.from_world(data=4, data_shard=2, expert=2)
    assert_on_every_rank({
        "off: alone": [c.mpi is None for c in (plain.ep_comm, plain.cp_ulysses_comm, plain.dp_replica_comm,
                                                plain.tp_comm, plain.pp_comm, plain.embedding_comm)] == [True] * 6,
        "off: shared": [plain.dp_shard_comm.mpi is plain.dp_cp_comm.mpi, plain.expert_dp_comm.mpi is plain.dp_cp_comm.mpi,
                        plain.dp_comm.mpi is plain.dp_cp_comm.mpi] == [True] * 3,
        "on: their own": (members(hybrid.dp_shard_comm), members(hybrid.dp_replica_comm), members(hybrid.ep_comm))
        == ([r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2], [r - r % 2, r - r % 2 + 1])
        if (r := MPI.COMM_WORLD.Get_rank()) is not None else False})
