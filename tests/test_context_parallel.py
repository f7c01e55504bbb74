"""Context parallelism: the zigzag split, the ring's bytes against the formula,
checkpoints from a cp mesh, and bad flags. (The online-softmax merge of blocks is
held to whole attention in test_kernels_vs_reference.py; training equivalence with
one process is in test_equivalence.py.)"""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.distributed.topology import Topology
from numpitron.context_parallel.zigzag import contiguous_chunks, local_positions, zigzag_chunks
from tests.harness import assert_on_every_rank, make_trainer, serial_reference, tiny_model, tiny_tokens, tiny_train
from tests.harness import error_lines, run_script, train_steps
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_split_covers_the_sequence_and_balances_the_work(cp):
    seq = 16
    positions = np.concatenate([local_positions(seq, cp, r) for r in range(cp)])
    assert sorted(positions) == list(range(seq))
    # (query chunk, key chunk) pairs with any visible key, per rank, over the whole ring
    assert block_pairs(zigzag_chunks, seq, cp) == [2 * cp + 1] * cp


def block_pairs(chunks, seq: int, cp: int) -> list[int]:
    """Per rank, the (query chunk, key chunk) pairs with any visible key over a whole ring."""
    return [sum(kc.position <= qc.last_position
                for owner in range(cp) for kc in chunks(seq // cp, cp, owner)
                for qc in chunks(seq // cp, cp, r)) for r in range(cp)]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_plain_split_gives_rank_r_r_plus_one_block_pairs(cp):
    """The contiguous split (docs/12-context-parallelism.md): rank r meets the key blocks of ranks 0..r, 1 to cp
    pairs of blocks twice the zigzag's chunks; in the zigzag's chunk squares of c x c
    scores, a diagonal square counted as half, its work is 4r + 2 against 2cp on every
    zigzag rank. Counted exactly, a query at position i sees i + 1 keys, and the two
    diagonal squares each rank meets add c/2 scores apiece beyond the halves."""
    seq = 16
    assert block_pairs(contiguous_chunks, seq, cp) == [r + 1 for r in range(cp)]
    c = seq // (2 * cp)
    plain = [int(sum(np.arange(ch.position, ch.last_position + 1).sum() + ch.stop - ch.start
                     for ch in contiguous_chunks(seq // cp, cp, r))) for r in range(cp)]
    zigzag = [int(sum(local_positions(seq, cp, r) + 1)) for r in range(cp)]
    assert plain == [(4 * r + 2) * c * c + c for r in range(cp)]
    assert zigzag == [2 * cp * c * c + c] * cp


@pytest.mark.parallel(nprocs=2)
def test_ring_moves_the_formula_bytes_and_a_cp_checkpoint_loads_on_one_process(tmp_path_factory):
    """Per layer and micro-batch each rank sends its K and V blocks cp - 1 times in the
    forward, and again in the backward with the gradients dK, dV travelling beside them
    (cp times: the last pass takes them home): 4 (cp - 1) + 2 cp blocks of
    B x T/cp x C/tp values."""
    model_cfg, train_cfg = tiny_model(), tiny_train()
    trainer = make_trainer(model_cfg, train_cfg, context=2)
    topo, cp = trainer.topo, 2
    trainer.topo.stats.reset()
    trainer.train_step(tiny_tokens())
    snap = topo.stats.snapshot()
    block = train_cfg.micro_batch_size * (model_cfg.seq_len // cp) * model_cfg.d_model * 8
    per_layer = (4 * (cp - 1) + 2 * cp) * block
    expected = trainer.num_microbatches * model_cfg.n_layers * per_layer
    checks = {"cp.send": (snap["cp.send"]["bytes"], expected), "cp.recv": (snap["cp.recv"]["bytes"], expected),
              "no tp or pp traffic": (sorted(k for k in snap if k.startswith(("tp.", "pp."))), [])}

    train_steps(trainer, 4)
    root = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("cp")) if topo.rank == 0 else None)
    path = save_checkpoint(root, trainer)
    serial = make_trainer(model_cfg, train_cfg, Topology.serial())
    load_checkpoint(path, serial)
    reference, _, _, _ = serial_reference(model_cfg, train_cfg, steps=8)
    checks["resumed on one process"] = rel_diff(train_steps(serial, 3), reference[5:]) <= EQUIV_RTOL_FLOAT64
    assert_on_every_rank(checks)


@pytest.mark.parametrize("args, message", [
    (["--context-parallel-size", "2", "--seq-len", "6"],
     "seq_len (6) must be divisible by 2 x the context-parallel size (4)"),
    (["--context-parallel-size", "2", "--seq-len", "2"],
     "seq_len (2) must be divisible by 2 x the context-parallel size (4)"),        # cp larger than the sequence allows
    (["--context-parallel-size", "0"], "context-parallel size must be positive"),
])
def test_bad_context_parallel_flags_are_one_line_from_one_rank(args, message):
    result = run_script(args + ["--max-iters", "1", "--no-progress"], nprocs=2, timeout=60)
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0], result.stderr
