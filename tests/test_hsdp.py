"""Hybrid sharding (HSDP, docs/09-zero-2-and-3.md): `--data-parallel-shard-size S` splits
the dp ranks into dp / S replicas of S; ZeRO shards over the cp x S ranks of a replica
(dp_shard) and averages each gradient slice over the replicas (dp_replica). The groups,
the two-level all-reduce against MPI's own, the same training as one process, memory
and bytes against the formula, checkpoints across meshes, and bad input.
"""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from numpitron.config import ParallelConfig
from numpitron.data_parallel.hierarchical import hierarchical_all_reduce, hierarchical_bytes
from numpitron.distributed.sharding import pad_to_multiple
from numpitron.distributed.topology import Topology, resolve_mesh
from numpitron.errors import UserError
from numpitron.layout import check_layout
from numpitron.optim.memory_report import memory_bytes
from tests.harness import (SMALLER, assert_on_every_rank, gathered, check_mesh, make_trainer, tiny_model, tiny_tokens,
                           tiny_train, train_steps)
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

F64 = 8


def members(comm):
    return gathered(comm, MPI.COMM_WORLD.Get_rank())


def second_step_bytes(trainer, tokens) -> dict:
    """Bytes by group and collective of a step after the first (which sets things up)."""
    trainer.train_step(tokens)
    trainer.topo.stats.reset()
    trainer.train_step(tokens)
    return {k: v["bytes"] for k, v in trainer.topo.stats.snapshot().items()}


@pytest.mark.parallel(nprocs=4)
def test_shard_and_replica_groups_split_dp_in_megatron_order():
    checks = {}
    hsdp = Topology.from_world(data=4, data_shard=2)            # ranks 0 1 | 2 3: one host each
    r = hsdp.rank
    checks["S=2 shard group: consecutive dp ranks"] = (members(hsdp.dp_shard_comm), [r - r % 2, r - r % 2 + 1])
    checks["S=2 replica group: the same place in each replica"] = (members(hsdp.dp_replica_comm), [r % 2, r % 2 + 2])
    checks["S=2 norm over one replica"] = (members(hsdp.dp_shard_model_comm), members(hsdp.dp_shard_comm))
    checks["S=2 ranks"] = ((hsdp.dp_shard_rank, hsdp.dp_replica_rank), (r % 2, r // 2))
    plain = Topology.from_world(data=4)                          # S = dp: today's ZeRO
    checks["S=dp shard group is dp_cp"] = (members(plain.dp_shard_comm), members(plain.dp_cp_comm))
    checks["S=dp one replica"] = (plain.dp_replica_comm.size, 1)
    replicate = Topology.from_world(context=2, data=2, data_shard=1)    # S = 1: ZeRO over cp only
    checks["S=1 shard group is cp"] = (members(replicate.dp_shard_comm), members(replicate.cp_comm))
    checks["S=1 replicas are dp"] = (members(replicate.dp_replica_comm), members(replicate.dp_comm))
    tp = Topology.from_world(tensor=2, data=2, data_shard=1)
    checks["tp2 S=1 replicas"] = (members(tp.dp_replica_comm), members(tp.dp_comm))
    checks["tp2 S=1 shard of one"] = (tp.dp_shard_comm.size, 1)
    checks["printout"] = "ZeRO shards over 2 of the dp ranks, 2 replicas" in str(hsdp)
    assert_on_every_rank(checks)


@pytest.mark.parallel(nprocs=4)
def test_two_level_all_reduce_equals_mpi_and_counts_each_tier_by_the_formula():
    """Integer-valued float64 sums are exact in any order: the two-level result must equal
    MPI's own bit for bit; each tier's bytes are hierarchical_bytes' (q = 2, h = 2)."""
    topo = Topology.from_world(data=4, data_shard=2)
    inner, outer, n = topo.dp_shard_comm, topo.dp_replica_comm, 1000
    mine = np.random.default_rng(topo.rank).integers(-1000, 1000, n).astype(np.float64)
    flat = topo.dp_comm.all_reduce(mine.copy())
    topo.stats.reset()
    two_level = hierarchical_all_reduce(mine.copy(), inner, outer)
    snap = {k: v["bytes"] for k, v in topo.stats.snapshot().items()}
    expected = hierarchical_bytes(n * F64, 2, 2)
    assert_on_every_rank({
        "same sum as MPI's all-reduce": np.array_equal(two_level, flat),
        "inside the host": ((snap["dp_shard.reduce_scatter"], snap["dp_shard.all_gather"]),
                            (expected["inner.reduce_scatter"], expected["inner.all_gather"])),
        "across hosts: a quarter of a flat all-reduce's bytes": (snap["dp_replica.all_reduce"], n * F64 / 2),
        "formula": (snap["dp_replica.all_reduce"], expected["outer.all_reduce"]),
        "nothing else": (sorted(snap), ["dp_replica.all_reduce", "dp_shard.all_gather", "dp_shard.reduce_scatter"]),
    })


@pytest.mark.parallel(nprocs=4)
def test_hsdp_trains_as_one_process():
    """float64, ten iterations: S = 2 of dp = 4 at each ZeRO stage (and one whose clip
    bites: the norm counts each element once); plain dp's two-level all-reduce; S = 1
    with tp, pp and cp (where the shard group is cp's two ranks)."""
    for mesh in (dict(data=4, data_shard=2, zero_stage=1), dict(data=4, data_shard=2, zero_stage=2, bucket_size=2000),
                 dict(data=4, data_shard=2, zero_stage=3), dict(data=4, data_shard=2, hierarchical_all_reduce=True),
                 dict(tensor=2, data=2, data_shard=1, zero_stage=2), dict(pipeline=2, data=2, data_shard=1, zero_stage=1),
                 dict(context=2, data=2, data_shard=1, zero_stage=3)):
        check_mesh(mesh)
    check_mesh(dict(data=4, data_shard=2, zero_stage=3), grad_clip=0.05)


@pytest.mark.parallel(nprocs=8)
def test_hsdp_with_tp_and_with_pp_trains_as_one_process(monkeypatch):
    """S = 2 of dp = 4 beside tp = 2 (two hosts of four ranks: a shard group is tp x S = 4
    consecutive ranks) and beside pp = 2 (four hosts of two ranks), hosts named as the
    cluster names them: each shard group on one host, each replica group across hosts,
    and ten float64 iterations equal to one process."""
    import socket
    rank = MPI.COMM_WORLD.rank
    for mesh, per_host in ((dict(tensor=2, data=4, data_shard=2, zero_stage=3), 4),
                           (dict(pipeline=2, data=4, data_shard=2, zero_stage=2), 2)):
        monkeypatch.setattr(socket, "gethostname", lambda: f"host{rank // per_host}")
        topo = check_mesh(mesh, model=SMALLER).trainer.topo
        hosts_of = {name: {r // per_host for r in members(comm)}
                    for name, comm in (("shard", topo.dp_shard_comm), ("replica", topo.dp_replica_comm))}
        assert_on_every_rank({f"{mesh}: shard group on one host": len(hosts_of["shard"]) == 1,
                              f"{mesh}: replicas on two hosts": len(hosts_of["replica"]) == 2})


@pytest.mark.parallel(nprocs=4)
def test_memory_is_zero_over_s_ranks_and_only_the_slice_crosses_replicas():
    """HSDP (dp = 4, S = 2) keeps per rank what ZeRO over 2 ranks keeps, to the byte
    (run beside it on each half of the world); its shard group moves what that ZeRO's
    dp moves; the replica group moves one all-reduce of the 1/S gradient slice."""
    tokens, checks = tiny_tokens(), {}
    halves = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank // 2, MPI.COMM_WORLD.rank)
    for stage in (1, 2, 3):
        train = tiny_train(global_batch_size=8)
        hsdp = make_trainer(train_cfg=train, data=4, data_shard=2, zero_stage=stage)
        zero = make_trainer(train_cfg=tiny_train(global_batch_size=4), topo=Topology.from_world(data=2, world=halves),
                            zero_stage=stage)
        moved = {trainer: second_step_bytes(trainer, tokens) for trainer in (hsdp, zero)}
        padded = pad_to_multiple(hsdp.model.store.numel, 2)
        item = hsdp.model_cfg.itemsize
        checks[f"stage {stage} memory equals ZeRO over S"] = (memory_bytes(hsdp.optimizer), memory_bytes(zero.optimizer))
        checks[f"stage {stage} state is 1/S"] = (hsdp.optimizer.adam.state_nbytes, 2 * padded // 2 * item)
        for kind in ("dp_shard.reduce_scatter", "dp_shard.all_gather"):
            checks[f"stage {stage} {kind}"] = (moved[hsdp][kind], moved[zero][kind])
        checks[f"stage {stage} replicas: one all-reduce of the slice"] = (
            moved[hsdp]["dp_replica.all_reduce"], 2 * (2 - 1) / 2 * (padded // 2 * item))
    assert_on_every_rank(checks)


MOE = dict(num_experts=4, moe_top_k=2)


@pytest.mark.parallel(nprocs=4)
def test_experts_shard_inside_a_replica_and_train_as_one_process():
    """dp = 4, S = 2: with ep = 1 each expert's state shards over the 2 expert_dp ranks
    of a replica and its slices are averaged across replicas, like the dense state's;
    with ep = 2 an ep group is one replica, which holds each expert once (a shard
    group of one). Ten float64 iterations equal to one process, every expert compared."""
    for mesh in (dict(data=4, data_shard=2, zero_stage=2), dict(data=4, data_shard=2, expert=2, zero_stage=1)):
        topo = check_mesh(mesh, model=MOE).trainer.topo
        r, ep = topo.rank, mesh.get("expert", 1)
        expected_shard = [r - r % 2, r - r % 2 + 1] if ep == 1 else [r]
        assert_on_every_rank({f"ep={ep} expert shard group": (members(topo.expert_dp_shard_comm), expected_shard),
                              f"ep={ep} expert slices' copies": (topo.dp_replica_comm.size, 2)})


@pytest.mark.parallel(nprocs=4)
def test_expert_memory_is_zero_over_s_over_ep_ranks_and_its_slice_crosses_replicas():
    """Beside ZeRO-2 on each half of the world (dp = 2, the experts over ep): HSDP's
    expert optimizer keeps the same bytes, its state is 1/(S/ep) of the padded expert
    store, and the replicas all-reduce the dense slice and the expert slice, nothing more."""
    tokens, checks = tiny_tokens(), {}
    halves = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank // 2, MPI.COMM_WORLD.rank)
    model = tiny_model(**MOE, **SMALLER)
    for ep in (1, 2):
        hsdp = make_trainer(model, tiny_train(global_batch_size=8), data=4, data_shard=2, expert=ep, zero_stage=2)
        zero = make_trainer(model, tiny_train(global_batch_size=4), zero_stage=2,
                            topo=Topology.from_world(data=2, expert=ep, world=halves))
        moved = {trainer: second_step_bytes(trainer, tokens) for trainer in (hsdp, zero)}
        dense, experts = hsdp.optimizers
        shard, item = 2 // ep, model.itemsize
        for name, mine, theirs in zip(("dense", "experts"), hsdp.optimizers, zero.optimizers):
            checks[f"ep={ep} {name} memory equals ZeRO over S"] = (memory_bytes(mine), memory_bytes(theirs))
        checks[f"ep={ep} expert state is 1/(S/ep)"] = (
            experts.adam.state_nbytes, 2 * pad_to_multiple(experts.store.numel, shard) // shard * item)
        for kind in ("expert_dp_shard.reduce_scatter", "expert_dp_shard.all_gather"):
            checks[f"ep={ep} {kind}"] = (moved[hsdp].get(kind), moved[zero].get(kind))
        slices = pad_to_multiple(dense.store.numel, 2) // 2 + pad_to_multiple(experts.store.numel, shard) // shard
        checks[f"ep={ep} replicas: one all-reduce of each slice"] = (moved[hsdp]["dp_replica.all_reduce"],
                                                                   2 * (2 - 1) / 2 * slices * item)
    assert_on_every_rank(checks)


@pytest.mark.parallel(nprocs=4)
def test_hsdp_checkpoints_load_on_other_meshes_and_back(shared_dir):
    """Saved under HSDP ZeRO-3 (each of the 4 ranks writes a quarter: the two copies of
    a slice split it), resumed on tp = 2 x dp = 2; saved from tp = 2 x pp = 2, resumed
    under HSDP ZeRO-2. Each continues one uninterrupted serial run."""
    model, tokens = tiny_model(**SMALLER), tiny_tokens(5000)
    train = tiny_train(global_batch_size=4, micro_batch_size=1)
    expected = train_steps(make_trainer(model, train, Topology.serial()), 6, tokens)

    source = make_trainer(model, train, data=4, data_shard=2, zero_stage=3)
    assert rel_diff(train_steps(source, 3, tokens), expected[:3]) <= EQUIV_RTOL_FLOAT64
    path = save_checkpoint(shared_dir / "hsdp", source)
    files = read_manifest(path)["files"]
    assert len(files) == 4 and all(entry["bytes"] > 0 for entry in files.values())
    pieces = [(p["kind"], p["name"], p["start"]) for p in read_manifest(path)["pieces"]]
    assert len(pieces) == len(set(pieces))                     # no range written twice
    resumed = make_trainer(model, tiny_train(global_batch_size=4), tensor=2, data=2, zero_stage=1)
    load_checkpoint(path, resumed)
    assert rel_diff(train_steps(resumed, 3, tokens), expected[3:]) <= EQUIV_RTOL_FLOAT64

    other = make_trainer(model, tiny_train(global_batch_size=4, micro_batch_size=2), tensor=2, pipeline=2)
    train_steps(other, 3, tokens)
    back = save_checkpoint(shared_dir / "tp-pp", other)
    hybrid = make_trainer(model, train, data=4, data_shard=2, zero_stage=2)
    load_checkpoint(back, hybrid)
    assert rel_diff(train_steps(hybrid, 3, tokens), expected[3:]) <= EQUIV_RTOL_FLOAT64


@pytest.mark.parallel(nprocs=4)
def test_expert_checkpoints_under_hsdp_load_on_another_mesh(shared_dir):
    """Saved under HSDP ZeRO-2 with experts sharded over S = 2 (each range of either
    store written once), resumed on dp = 4 with ep = 2: one uninterrupted serial run."""
    model, tokens = tiny_model(**MOE, **SMALLER), tiny_tokens(5000)
    train = tiny_train(global_batch_size=4, micro_batch_size=1)
    expected = train_steps(make_trainer(model, train, Topology.serial()), 6, tokens)
    source = make_trainer(model, train, data=4, data_shard=2, zero_stage=2)
    assert rel_diff(train_steps(source, 3, tokens), expected[:3]) <= EQUIV_RTOL_FLOAT64
    path = save_checkpoint(shared_dir / "hsdp-experts", source)
    pieces = [(p["kind"], p["name"], p["start"]) for p in read_manifest(path)["pieces"]]
    assert len(pieces) == len(set(pieces)) and any(".experts." in name for _, name, _ in pieces)
    resumed = make_trainer(model, train, data=4, expert=2, zero_stage=1)
    load_checkpoint(path, resumed)
    assert rel_diff(train_steps(resumed, 3, tokens), expected[3:]) <= EQUIV_RTOL_FLOAT64


def test_a_shard_size_that_does_not_divide_dp_is_one_line():
    with pytest.raises(UserError, match="--data-parallel-shard-size 3 must divide the data-parallel size 4"):
        resolve_mesh(4, 1, 1, None, data_shard=3)
    with pytest.raises(UserError, match="data-parallel shard size must be positive"):
        resolve_mesh(4, 1, 1, None, data_shard=-1)
    with pytest.raises(UserError, match=r"the expert-parallel size \(2\) must divide --data-parallel-shard-size x context parallel size \(1 x 1\)"):
        check_layout(tiny_model(**MOE), tiny_train(), resolve_mesh(4, 1, 1, None, expert=2, data_shard=1))
    with pytest.raises(UserError, match="--hierarchical-all-reduce is for plain data parallelism"):
        ParallelConfig(zero_stage=2, hierarchical_all_reduce=True).validate()


@pytest.mark.parallel(nprocs=4)
def test_a_shard_group_across_hosts_that_need_not_be_is_refused_on_every_rank(monkeypatch):
    """Two hosts of two ranks, filled round robin (rank r on host r % 2): S = 2 would put
    each shard group on both hosts although one host holds two ranks. Filled in order
    (ranks 0 1 | 2 3), the same mesh is accepted; S = 4 needs both hosts and is too."""
    import socket
    rank = MPI.COMM_WORLD.rank
    monkeypatch.setattr(socket, "gethostname", lambda: f"host{rank % 2}")
    with pytest.raises(UserError, match=r"ranks 0-1 \(tp x cp x S = 2 consecutive ranks\) would shard across "
                                        r"hosts host0, host1, though a host holds 2 ranks"):
        Topology.from_world(data=4, data_shard=2)
    Topology.from_world(data=4)
    monkeypatch.setattr(socket, "gethostname", lambda: f"host{rank // 2}")
    Topology.from_world(data=4, data_shard=2)
