"""Checkpoints across meshes: what one layout saves, any other layout resumes exactly.

Each test trains on one mesh, saves, rebuilds the same ranks as a different mesh,
loads and continues; the losses must be those of one uninterrupted serial run
(computed inside every rank: a serial Trainer communicates with nobody).
"""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint
from numpitron.config import ModelConfig, TrainConfig
from numpitron.distributed.gather import gather_full
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.trainer import Trainer
from tests.harness import SMALLER, make_trainer, rewrite_manifest, tiny_model, train_steps, whole_buffers
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

MODEL = tiny_model(**SMALLER)
TOKENS = np.random.default_rng(0).integers(0, 65, 5000).astype(np.uint16)


def train_cfg(micro_batch_size=2) -> TrainConfig:
    # The global batch stays 4 on every mesh, so every mesh trains on the same data.
    return TrainConfig(micro_batch_size=micro_batch_size, global_batch_size=4, max_iters=10, warmup_iters=2,
                       seed=1, eval_iters=1, eval_interval=1)


def mesh_trainer(tensor=1, pipeline=1, data=1, zero_stage=0, micro_batch_size=2) -> Trainer:
    return make_trainer(MODEL, train_cfg(micro_batch_size), tensor=tensor, pipeline=pipeline, data=data,
                        zero_stage=zero_stage)


def full_state(trainer: Trainer) -> dict | None:
    """{params, adam_m, adam_v: {name: full tensor}} on world rank 0 (collective)."""
    return gather_full(trainer.model, trainer.topo, whole_buffers(trainer.optimizer))


@pytest.mark.parallel(nprocs=4)
def test_tp2_pp2_checkpoint_resumes_on_dp4_zero1_and_tp2_dp2_zero1(shared_dir):
    serial = make_trainer(MODEL, train_cfg(), Topology.serial())
    expected = train_steps(serial, 6, TOKENS)

    source = mesh_trainer(tensor=2, pipeline=2)
    assert rel_diff(train_steps(source, 3, TOKENS), expected[:3]) <= EQUIV_RTOL_FLOAT64
    path = save_checkpoint(shared_dir, source)
    assert path == shared_dir / "iter_000003" and latest_checkpoint(shared_dir) == path
    manifest = read_manifest(path)
    assert (manifest["mesh"]["tensor"], manifest["mesh"]["pipeline"]) == (2, 2)
    # The vocabulary is padded to 66 rows on tp=2; the manifest records both shapes.
    assert manifest["tensors"]["embedding.token.weight"]["shape"] == [65, 32]
    assert manifest["tensors"]["embedding.token.weight"]["full_shape"] == [66, 32]
    # Every rank wrote its own shard: four files, each with something in it.
    assert sorted(manifest["files"]) == [f"shards/rank-{r:05d}.bin" for r in range(4)]
    assert all(entry["bytes"] > 0 for entry in manifest["files"].values())

    for mesh in (dict(data=4, zero_stage=1, micro_batch_size=1), dict(tensor=2, data=2, zero_stage=1)):
        resumed = mesh_trainer(**mesh)
        load_checkpoint(path, resumed)
        assert resumed.iteration == 3 and resumed.optimizer.adam.step_count == 3
        losses = train_steps(resumed, 3, TOKENS)
        assert rel_diff(losses, expected[3:]) <= EQUIV_RTOL_FLOAT64, (mesh, losses, expected[3:])


@pytest.mark.parallel(nprocs=2)
def test_tp2_zero0_state_loads_exactly_on_dp2_zero1(shared_dir):
    source = mesh_trainer(tensor=2)
    train_steps(source, 3, TOKENS)
    source.best_val_loss = 4.5
    saved = full_state(source)
    path = save_checkpoint(shared_dir, source)

    resumed = mesh_trainer(data=2, zero_stage=1)
    load_checkpoint(path, resumed)
    assert (resumed.iteration, resumed.best_val_loss, resumed.optimizer.adam.step_count) == (3, 4.5, 3)
    # Each rank holds only its half of m and v: their gather must be the saved state.
    loaded = full_state(resumed)
    if MPI.COMM_WORLD.rank == 0:
        for kind in ("params", "adam_m", "adam_v"):
            assert saved[kind].keys() == loaded[kind].keys()
            for name in saved[kind]:
                assert np.array_equal(saved[kind][name], loaded[kind][name]), (kind, name)


@pytest.mark.parallel(nprocs=2)
def test_failures_on_one_rank_fail_every_rank(shared_dir):
    trainer = mesh_trainer(data=2)
    blocker = shared_dir / "a-file"
    if MPI.COMM_WORLD.rank == 0:
        blocker.write_text("not a directory")
    MPI.COMM_WORLD.barrier()
    # Rank 0 cannot write: every rank raises instead of waiting for it.
    with pytest.raises(UserError, match="cannot write checkpoint to"):
        save_checkpoint(blocker, trainer)
    path = save_checkpoint(shared_dir / "ckpts", trainer)
    # Only rank 1's flags disagree with the checkpoint; rank 0 must not go on alone.
    flags = ModelConfig(**{**MODEL.__dict__, "n_layers": 4}) if MPI.COMM_WORLD.rank == 1 else MODEL
    odd = make_trainer(flags, train_cfg(), trainer.topo)
    with pytest.raises(UserError, match="n_layers 2 != 4"):
        load_checkpoint(path, odd)


@pytest.mark.parallel(nprocs=2)
def test_zero3_checkpoint_resumes_on_one_process_and_back(shared_dir):
    """ZeRO-3 holds only slices of everything; its checkpoint is still the logical model,
    and one process with plain AdamW continues the same run from it, and the reverse."""
    expected = train_steps(make_trainer(MODEL, train_cfg(), Topology.serial()), 6, TOKENS)
    source = mesh_trainer(data=2, zero_stage=3)
    train_steps(source, 3, TOKENS)
    path = save_checkpoint(shared_dir / "from-zero3", source)
    one = make_trainer(MODEL, train_cfg(), Topology.serial())
    load_checkpoint(path, one)
    assert rel_diff(train_steps(one, 3, TOKENS), expected[3:]) <= EQUIV_RTOL_FLOAT64

    if MPI.COMM_WORLD.rank == 0:                 # one process saves after 3 steps...
        first = make_trainer(MODEL, train_cfg(), Topology.serial())
        train_steps(first, 3, TOKENS)
        save_checkpoint(shared_dir / "from-one", first)
    MPI.COMM_WORLD.barrier()
    resumed = mesh_trainer(data=2, zero_stage=3)   # ...and ZeRO-3 over two ranks goes on
    load_checkpoint(latest_checkpoint(shared_dir / "from-one"), resumed)
    assert resumed.iteration == 3
    assert rel_diff(train_steps(resumed, 3, TOKENS), expected[3:]) <= EQUIV_RTOL_FLOAT64


@pytest.mark.parallel(nprocs=2)
def test_a_stage_reads_only_the_shards_that_hold_its_tensors(shared_dir, monkeypatch):
    """pp = 2: each rank writes its own stage; on loading, the first stage maps only its
    own shard, and the last stage its own and the first's (for the tied embedding)."""
    from numpitron.checkpoint.sharded import ShardedReader
    source = mesh_trainer(pipeline=2)
    train_steps(source, 2, TOKENS)
    path = save_checkpoint(shared_dir, source)
    opened = []
    original = ShardedReader._file

    def spy(self, relpath):
        opened.append(relpath)
        return original(self, relpath)
    monkeypatch.setattr(ShardedReader, "_file", spy)
    resumed = mesh_trainer(pipeline=2)
    load_checkpoint(path, resumed)
    expected = {"shards/rank-00000.bin"} | ({"shards/rank-00001.bin"} if MPI.COMM_WORLD.rank == 1 else set())
    assert set(opened) == expected
    assert np.array_equal(resumed.optimizer.state.whole("params"), source.optimizer.state.whole("params"))


@pytest.mark.parallel(nprocs=2)
def test_checkpoints_move_between_schedules_and_virtual_stage_counts(shared_dir):
    """Interleaving changes which blocks a rank holds (rank 0: blocks 0 and 2 of 4), and
    so does a V (rank 0: blocks 0 and 3, and the one token embedding for both ends),
    not their names: interleaved v=2 -> ZB-V -> zero-bubble -> DualPipeV -> 1F1B v=1 on
    one stage -> interleaved, two iterations each, one uninterrupted serial trajectory."""
    model = tiny_model(n_layers=4, n_heads=2)
    serial = make_trainer(model, train_cfg(), Topology.serial())
    chain = [dict(pipeline=2, schedule="interleaved", virtual_stages=2), dict(pipeline=2, schedule="zb-v"),
             dict(pipeline=2, schedule="zero-bubble"), dict(pipeline=2, schedule="dualpipev"),
             dict(data=2, schedule="1f1b"), dict(pipeline=2, schedule="interleaved", virtual_stages=2)]
    expected = train_steps(serial, 2 * len(chain), TOKENS)
    path = None
    for step, layout in enumerate(chain):
        trainer = make_trainer(model, train_cfg(micro_batch_size=1), **layout)     # a V needs m >= 2p - 1 = 3
        if path is not None:
            load_checkpoint(path, trainer)
        assert trainer.iteration == 2 * step
        losses = train_steps(trainer, 2, TOKENS)
        assert rel_diff(losses, expected[2 * step:2 * step + 2]) <= EQUIV_RTOL_FLOAT64, (layout, losses)
        path = save_checkpoint(shared_dir / str(step), trainer)
        names = set(read_manifest(path)["tensors"])
        assert {f"blocks.{i}.attn.qkv.weight" for i in range(4)} <= names


@pytest.mark.parallel(nprocs=2)
def test_expert_routing_bias_resumes_on_another_mesh(shared_dir):
    """Aux-loss-free balancing's bias is saved whole in the manifest: trained on
    dp = ep = 2, resumed on pp = 2 (each stage routing its own block), the run goes on
    as one uninterrupted serial run; a corrupt bias is one line and changes nothing."""
    model_cfg = tiny_model(**SMALLER, num_experts=4, moe_top_k=2, moe_load_balancing="bias", moe_bias_update_rate=0.01)
    expected = train_steps(make_trainer(model_cfg, train_cfg(), Topology.serial()), 6, TOKENS)
    source = make_trainer(model_cfg, train_cfg(), data=2, expert=2)
    assert rel_diff(train_steps(source, 3, TOKENS), expected[:3]) <= EQUIV_RTOL_FLOAT64
    path = save_checkpoint(shared_dir / "bias", source)
    saved = np.array(read_manifest(path)["moe_routing_bias"])
    assert np.array_equal(saved, source.model.experts.bias) and np.any(saved)
    resumed = make_trainer(model_cfg, train_cfg(), pipeline=2)
    load_checkpoint(path, resumed)
    assert np.array_equal(resumed.model.experts.bias, saved)
    assert rel_diff(train_steps(resumed, 3, TOKENS), expected[3:]) <= EQUIV_RTOL_FLOAT64
    if MPI.COMM_WORLD.rank == 0:
        rewrite_manifest(path, lambda manifest: manifest.update(moe_routing_bias=[[0.0, 1.0]]))
    MPI.COMM_WORLD.barrier()
    fresh = make_trainer(model_cfg, train_cfg(), pipeline=2)
    with pytest.raises(UserError, match="moe_routing_bias is not 2 x 4 finite numbers"):
        load_checkpoint(path, fresh)
    assert fresh.iteration == 0 and not np.any(fresh.model.experts.bias)
