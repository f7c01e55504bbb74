"""Context parallelism: the online-softmax merge on its own, the zigzag split, the ring's
bytes against the formula, checkpoints from a cp mesh, and bad flags. (Training
equivalence with one process is in test_equivalence.py.)"""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.distributed.topology import Topology
from numpitron.nn.blockwise_attention import AttentionState, attend_block, attend_block_backward, query_tiles
from numpitron.nn.blockwise_attention import visible_keys
from numpitron.parallel.context import Chunk, local_positions, zigzag_chunks
from tests.harness import assert_on_every_rank, make_trainer, serial_reference, tiny_model, tiny_tokens, tiny_train
from tests.harness import train_steps
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

B, H, T, D = 2, 3, 12, 4


def dense_attention(q, k, v):
    """Plain causal softmax attention over positions 0..T-1 and its gradients for a
    given dO, as the reference."""
    s = q @ k.transpose(0, 1, 3, 2) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p @ v, p


@pytest.mark.parametrize("tile", [None, 3])
def test_blockwise_attention_equals_plain_softmax_in_any_block_order(tile):
    """Keys arrive in three blocks, in an order where some query chunks see nothing of
    the first block (fully masked: skipped) and others see it whole; in query tiles of
    3 rows some tiles see only part of a block (cut, and masked): the merged output and
    every gradient equal plain attention's."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, H, T, D)) for _ in range(4))
    expected, p = dense_attention(q, k, v)
    ds = p * (dout @ v.transpose(0, 1, 3, 2) - (dout * expected).sum(-1, keepdims=True))
    grads = {"dq": ds @ k, "dk": ds.transpose(0, 1, 3, 2) @ q, "dv": p.transpose(0, 1, 3, 2) @ dout}

    q_chunks = [Chunk(0, 4, 0), Chunk(4, 8, 4), Chunk(8, 12, 8)]
    if tile:
        q_chunks = query_tiles(q_chunks, tile)
        assert visible_keys(Chunk(3, 6, 3), [Chunk(0, 4, 4)]) == [Chunk(0, 2, 4)]
    blocks = [(8, 12), (0, 4), (4, 8)]               # the latest keys first
    state, saved = AttentionState(q), []
    for lo, hi in blocks:
        saved.append(attend_block(q, q_chunks, k[:, :, lo:hi], v[:, :, lo:hi], [Chunk(0, hi - lo, lo)], state))
    # only the last query chunk sees the latest keys (and, in tiles, the tile before it)
    assert [group.key_end for group in saved[0]] == ([3, 4] if tile else [4])
    assert rel_diff(state.out, expected) <= EQUIV_RTOL_FLOAT64

    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    d_rowsum = (dout * state.out).sum(-1, keepdims=True)
    for (lo, hi), block_saved in zip(blocks, saved):
        attend_block_backward(block_saved, q, k[:, :, lo:hi], v[:, :, lo:hi], dout, d_rowsum, state, dq,
                              dk[:, :, lo:hi], dv[:, :, lo:hi])
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert rel_diff(got, grads[name]) <= EQUIV_RTOL_FLOAT64, name


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_split_covers_the_sequence_and_balances_the_work(cp):
    seq = 16
    positions = np.concatenate([local_positions(seq, cp, r) for r in range(cp)])
    assert sorted(positions) == list(range(seq))
    # (query chunk, key chunk) pairs with any visible key, per rank, over the whole ring
    pairs = [sum(kc.position <= qc.last_position
                 for owner in range(cp) for kc in zigzag_chunks(seq // cp, cp, owner)
                 for qc in zigzag_chunks(seq // cp, cp, r)) for r in range(cp)]
    assert pairs == [2 * cp + 1] * cp


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
    from tests.test_cli import error_lines, run
    result = run(args + ["--max-iters", "1", "--no-progress"], nprocs=2, timeout=60)
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and message in lines[0], result.stderr
