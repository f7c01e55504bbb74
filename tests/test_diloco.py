"""DiLoCo (diloco/, docs/18-across-slow-links.md) held to the algorithms it reduces to,
in float64: one inner step of plain SGD with η = 1 and no momentum is plain data
parallelism; one replica with η = 1 and no momentum is plain training, for any H and
any inner optimizer; a replica that is itself a mesh trains as one process per replica."""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.build import build_trainer
from numpitron.config import ParallelConfig
from numpitron.diloco.replicas import replica_topology
from numpitron.distributed.topology import Mesh, Topology
from numpitron.layout import check_layout
from tests.harness import (SMALLER, assert_close_on_every_rank, make_trainer, run, serial_reference, tiny_model,
                           tiny_train)
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

MODEL = tiny_model(**SMALLER)


def diloco_trainer(train, mesh: Mesh, world=None, **parallel):
    """A DiLoCo run's trainer on `mesh` (the whole job's sizes), checked as the CLI checks."""
    parallel_cfg = ParallelConfig(**parallel).validate()
    check_layout(MODEL, train, mesh, parallel_cfg)
    topo = replica_topology(world or MPI.COMM_WORLD, mesh, train.diloco_replicas)
    return build_trainer(MODEL, parallel_cfg, train, topo)


def param_diff(params, expected) -> float:
    if params is None or expected is None:
        return 0.0
    assert params.keys() == expected.keys()
    return max(rel_diff(params[k], expected[k]) for k in expected)


@pytest.mark.parallel(nprocs=2)
def test_one_sgd_inner_step_with_unit_outer_lr_is_plain_data_parallelism():
    """p(1 - lr wd) - lr g is linear: the mean of the replicas' steps is the step of the
    mean gradient. Clipping by each replica's own norm would not be, hence --grad-clip 0."""
    plain = dict(optimizer="sgd", grad_clip=0.0, lr=0.1, min_lr=0.01)
    train = tiny_train(**plain, diloco_replicas=2, diloco_inner_steps=1, diloco_outer_lr=1.0,
                       diloco_outer_momentum=0.0)
    trainer = diloco_trainer(train, Mesh(1, 1, 2))
    losses, _, params, _ = run(trainer, 6)
    ref_losses, _, ref_params, reference = run(make_trainer(MODEL, tiny_train(**plain), data=2), 6)
    assert trainer.topo.dp == 1 and trainer.readers == (2, MPI.COMM_WORLD.rank)
    assert_close_on_every_rank({"loss": rel_diff(losses, ref_losses), "params": param_diff(params, ref_params)},
                               EQUIV_RTOL_FLOAT64)
    # The outer all-reduce moves each rank's whole stage every step: 2 (R-1)/R of it.
    store = trainer.optimizer.store
    step = trainer.train_step(np.random.default_rng(0).integers(0, 65, 6000).astype(np.uint16))
    assert trainer.topo.stats.bytes["diloco.all_reduce"] > 0
    assert step["diloco_bytes"] == trainer.topo.stats.bytes["diloco.all_reduce"] >= store.size * store.dtype.itemsize


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sgd"])
def test_one_replica_with_unit_outer_lr_and_no_momentum_is_plain_training(optimizer):
    train = dict(optimizer=optimizer, global_batch_size=4)
    diloco = tiny_train(**train, diloco_replicas=1, diloco_inner_steps=3, diloco_outer_lr=1.0,
                        diloco_outer_momentum=0.0)
    losses, norms, params, _ = run(make_trainer(MODEL, diloco, Topology.serial()), 7)
    ref_losses, ref_norms, ref_params, _ = serial_reference(MODEL, tiny_train(**train), steps=7)
    assert rel_diff(losses, ref_losses) <= EQUIV_RTOL_FLOAT64 and rel_diff(norms, ref_norms) <= EQUIV_RTOL_FLOAT64
    assert param_diff(params, ref_params) <= EQUIV_RTOL_FLOAT64


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("inner", [dict(tp=2), dict(zero_stage=1), dict(zero_stage=3), dict(zero_stage=1, dp_shard=1),
                                   dict(zero_stage=1, diloco_fragments=2, diloco_overlap_steps=1)],
                         ids=["tp2", "zero1", "zero3", "hsdp", "zero1-streaming"])
def test_a_replica_that_is_a_mesh_trains_like_one_process_per_replica(inner):
    """Two replicas of two ranks each (tp = 2, or dp = 2 with ZeRO, or HSDP with shards of
    one rank and two copies) against two replicas
    of one process each (run twice, on ranks 0-1 and 2-3), through three rounds of H = 2
    with AdamW inside and Nesterov outside: losses and every parameter. Streaming: each
        ZeRO slice's piece of a fragment travels on its own, and lands a step later,
    merged with each replica's own progress (so the replicas differ: compared on rank 0)."""
    streaming = {k: inner.pop(k) for k in ("diloco_fragments", "diloco_overlap_steps") if k in inner}
    train = tiny_train(diloco_replicas=2, diloco_inner_steps=2, diloco_outer_lr=0.7, diloco_outer_momentum=0.9,
                       **streaming)
    tp = inner.pop("tp", 1)
    shard = inner.pop("dp_shard", 0)
    losses, _, params, _ = run(diloco_trainer(train, Mesh(tp, 1, 4 // tp, dp_shard=shard), **inner), 6)
    world = MPI.COMM_WORLD
    halves = world.Split(world.rank // 2, world.rank)
    ref_losses, _, ref_params, _ = run(diloco_trainer(train, Mesh(1, 1, 2), world=halves), 6)
    # Compared on world ranks 0 and 2: the first rank of a replica of each run (after a
    # round every replica holds the same parameters; streaming's merge keeps each
    # replica's own progress, so there only rank 0, replica 0 in both runs).
    compared = (0,) if streaming else (0, 2)
    assert_close_on_every_rank({"loss": rel_diff(losses, ref_losses),
                                "params": param_diff(params, ref_params) if world.rank in compared else 0.0},
                               EQUIV_RTOL_FLOAT64)


@pytest.mark.parallel(nprocs=2)
def test_a_run_resumes_mid_round_bit_for_bit(shared_dir):
    """Saved after step 4 of rounds of H = 3 (one step into the second round), each
    replica into its own checkpoint (its inner AdamW moments, θ_start and the outer
    momentum; the phase is the iteration modulo H), and resumed by fresh trainers: the
    same losses and parameters as the uninterrupted run, bit for bit."""
    from numpitron.checkpoint import load_checkpoint, save_checkpoint
    train = tiny_train(diloco_replicas=2, diloco_inner_steps=3)
    tokens = np.random.default_rng(0).integers(0, 65, 6000).astype(np.uint16)
    whole = diloco_trainer(train, Mesh(1, 1, 2))
    expected = [whole.train_step(tokens)["train_loss"] for _ in range(10)]
    first = diloco_trainer(train, Mesh(1, 1, 2))
    for _ in range(4):
        first.train_step(tokens)
    path = save_checkpoint(shared_dir / f"replica-{first.topo.replicas.index}", first)
    resumed = diloco_trainer(train, Mesh(1, 1, 2))
    load_checkpoint(path, resumed)
    assert resumed.iteration == 4 and resumed.optimizer.adam.momentum.any()
    losses = [resumed.train_step(tokens)["train_loss"] for _ in range(6)]
    assert losses == expected[4:]
    assert np.array_equal(resumed.optimizer.store.data, whole.optimizer.store.data)
    assert np.array_equal(resumed.optimizer.adam.start, whole.optimizer.adam.start)
