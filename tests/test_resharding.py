"""A checkpoint saved on tp=2 x pp=2 x dp=2 with ZeRO-1 resumes on any mesh.

Eight ranks train 6 iterations on the full 3D mesh and save. Then, for each target
layout, the first k ranks form a smaller world, load the checkpoint, and train 6
more: the losses must equal those of one process training 12 iterations straight.
"""

import shutil
import tempfile
from pathlib import Path

import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.distributed.topology import Topology
from tests.harness import make_trainer, serial_reference, train_steps, tiny_model, tiny_train
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

TARGETS = [dict(), dict(tensor=2), dict(pipeline=2), dict(data=2, zero_stage=1), dict(tensor=2, data=2)]


@pytest.mark.parallel(nprocs=8)
def test_save_on_3d_mesh_resume_on_every_layout():
    world = MPI.COMM_WORLD
    model_cfg, train_cfg = tiny_model(), tiny_train(max_iters=12)
    root = Path(world.bcast(tempfile.mkdtemp(prefix="numpitron-reshard-") if world.rank == 0 else None))
    try:
        topo = Topology.from_world(2, 2, 2)
        source = make_trainer(model_cfg, train_cfg, topo, zero_stage=1)
        first_half = train_steps(source, 6)
        path = save_checkpoint(root, source, keep=1)
        reference, _, _, _ = serial_reference(model_cfg, train_cfg, steps=12)
        diffs = {"first half": rel_diff(first_half, reference[:6])}
        for target in TARGETS:
            size = target.get("tensor", 1) * target.get("pipeline", 1) * target.get("data", 1)
            sub = world.Split(0 if world.rank < size else MPI.UNDEFINED, world.rank)
            if sub != MPI.COMM_NULL:
                sub_topo = Topology.from_world(target.get("tensor", 1), target.get("pipeline", 1),
                                               target.get("data", 1), world=sub)
                strategy = {k: v for k, v in target.items() if k not in ("tensor", "pipeline", "data")}
                resumed = make_trainer(model_cfg, train_cfg, sub_topo, **strategy)
                load_checkpoint(path, resumed)
                assert resumed.iteration == 6
                diffs[str(target)] = rel_diff(train_steps(resumed, 6), reference[6:])
                sub.Free()
            world.Barrier()
        # every rank learns every figure, then all assert the same thing
        merged = {}
        for d in world.allgather(diffs):
            merged.update(d)
        assert len(merged) == 1 + len(TARGETS), merged
        assert max(merged.values()) <= EQUIV_RTOL_FLOAT64, merged
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
