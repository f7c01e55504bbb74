"""Sequence parallelism and recomputation: the activation bytes a block keeps, measured
against the formula; the bytes sequence parallelism moves against plain tensor
parallelism's; resuming across sp on/off; bad flags. (Training equivalence with one
process is in test_equivalence.py, finite differences of the wrapper in test_layers.py.)"""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.distributed.topology import Topology
from numpitron.transformer.activation_memory import block_activation_bytes
from numpitron.nn.cache_bytes import cache_nbytes
from tests.harness import assert_on_every_rank, make_trainer, serial_reference, tiny_model, tiny_tokens, tiny_train
from tests.harness import error_lines, run_script, train_steps
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

MODES = ["none", "selective", "full"]


def block_cache_bytes(trainer) -> list[int]:
    """cache_nbytes of each block's cache after one forward of the first micro-batch."""
    ids, targets = trainer.microbatches(tiny_tokens(), "train", 0)[0]
    model = trainer.model
    _, caches = model.forward(ids if model.first else np.zeros(model.input_shape(*ids.shape)), targets)
    first = 1 if model.first else 0
    return [cache_nbytes(c) for c in caches[first:first + len(model.blocks)]]


@pytest.mark.parametrize("recompute", MODES)
def test_one_process_block_memory_is_the_formula(recompute):
    cfg, train = tiny_model(), tiny_train()
    trainer = make_trainer(cfg, train, Topology.serial(), recompute=recompute)
    expected = block_activation_bytes(train.micro_batch_size, cfg.seq_len, cfg.d_model, cfg.n_heads,
                                      recompute=recompute)
    assert block_cache_bytes(trainer) == [expected] * cfg.n_layers


@pytest.mark.parallel(nprocs=2)
def test_tp2_block_memory_with_and_without_sp_and_the_bytes_sp_moves(tmp_path_factory):
    cfg, train, checks = tiny_model(), tiny_train(), {}
    B, T, C, H = train.micro_batch_size, cfg.seq_len, cfg.d_model, cfg.n_heads
    for sp in (False, True):
        for recompute in MODES:
            trainer = make_trainer(cfg, train, tensor=2, sequence_parallel=sp, recompute=recompute)
            checks[f"sp={sp} {recompute}"] = (block_cache_bytes(trainer),
                                              [block_activation_bytes(B, T, C, H, 2, sp, recompute)] * cfg.n_layers)
    # Sequence parallelism divides every term by tp.
    checks["sp divides by tp"] = (2 * block_activation_bytes(B, T, C, H, 2, True), block_activation_bytes(B, T, C, H))

    # Bytes: sp moves what plain tp moves, plus one all-gather per column-parallel layer
    # (qkv, fc, the head) in the backward to rebuild its input for the weight gradient,
    # plus one all-reduce of the replicated parameters' partial gradients.
    moved = {}
    for sp in (False, True):
        trainer = make_trainer(cfg, train, tensor=2, sequence_parallel=sp)
        trainer.topo.stats.reset()
        trainer.train_step(tiny_tokens())
        snap = trainer.topo.stats.snapshot()
        moved[sp] = sum(v["bytes"] for k, v in snap.items() if k.startswith("tp."))
        replicated = sum(p.grad.size for p in trainer.model.parameters() if p.split_axis is None)
    activation = B * T * C * 8
    regathers = trainer.num_microbatches * (2 * cfg.n_layers + 1) * activation / 2
    checks["sp bytes = tp bytes + re-gathers + partial grads"] = (moved[True], moved[False] + regathers
                                                                  + 2 * (1 / 2) * replicated * 8)

    # A checkpoint written with sp resumes without it on the same trajectory.
    trainer = make_trainer(cfg, train, tensor=2, sequence_parallel=True, recompute="selective")
    first = train_steps(trainer, 4)
    root = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("sp")) if trainer.topo.rank == 0 else None)
    path = save_checkpoint(root, trainer)
    plain = make_trainer(cfg, train, tensor=2)
    load_checkpoint(path, plain)
    reference, _, _, _ = serial_reference(cfg, train, steps=7)
    checks["resume across sp"] = rel_diff(first + train_steps(plain, 3), reference) <= EQUIV_RTOL_FLOAT64
    assert_on_every_rank(checks)


@pytest.mark.parametrize("args, nprocs, message", [
    (["--sequence-parallel"], None, "--sequence-parallel splits the sequence over tensor-parallel ranks"),
    (["--sequence-parallel", "--tensor-parallel-size", "2", "--seq-len", "15"], 2,
     "seq_len (15) / context-parallel size (1) must be divisible by the tensor-parallel size (2)"),
    (["--recompute", "some"], None, "invalid choice: 'some'"),
])
def test_bad_sequence_parallel_flags_are_one_line(args, nprocs, message):
    result = run_script(args + ["--max-iters", "1", "--no-progress"], nprocs=nprocs, timeout=60)
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0], result.stderr
