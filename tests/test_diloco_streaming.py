"""Streaming DiLoCo (diloco/streaming.py, docs/18-across-slow-links.md) in float64: held
to a reference that takes the outer steps by hand over two one-process replicas (so
F = 1, τ = 0 is DiLoCo), to plain training with one replica, to the bytes of the book's
formula per step, and resumed bit for bit with an exchange in flight."""

import numpy as np
import pytest
from mpi4py import MPI

from numpitron.diloco.exchange import CHUNK, message_bytes, pack, unpack
from numpitron.diloco.outer import held_slice
from numpitron.distributed.sharding import balanced_bounds
from numpitron.distributed.topology import Mesh, Topology
from numpitron.trainer import Readers
from tests.harness import SMALLER, assert_close_on_every_rank, make_trainer, run, serial_reference, tiny_model, \
    tiny_tokens, tiny_train
from tests.test_diloco import diloco_trainer, param_diff
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

MODEL = tiny_model(**SMALLER)


def by_hand(train, steps: int):
    """Two replicas as two one-process trainers, each reading its half of every batch,
    and the outer steps of the module's docstring taken here on their flat buffers."""
    plain = {name: getattr(train, name) for name in ("optimizer", "lr", "min_lr", "grad_clip")}
    replicas = [make_trainer(MODEL, tiny_train(**plain), Topology.serial()) for _ in range(2)]
    for k, trainer in enumerate(replicas):
        trainer.readers = Readers(2, k)
        trainer.set_batch(0)
    H, F = train.diloco_inner_steps, train.diloco_fragments
    tau, alpha = train.diloco_overlap_steps, train.diloco_merge_alpha
    thetas = [held_slice(t.optimizer) for t in replicas]
    start, m, in_flight, losses = thetas[0].copy(), np.zeros_like(thetas[0]), [], []
    for i in range(1, steps + 1):
        losses.append(np.mean([t.train_step(tiny_tokens())["train_loss"] for t in replicas]))
        for p in range(F):
            if i % H == p * H // F:
                lo, hi = balanced_bounds(start.size, F, p)
                delta = (start[lo:hi] - thetas[0][lo:hi]) + (start[lo:hi] - thetas[1][lo:hi])
                in_flight.append((min(i + tau, train.max_iters), lo, hi, delta * 0.5))
        for lands, lo, hi, delta in [e for e in in_flight if e[0] <= i]:
            in_flight.remove((lands, lo, hi, delta))
            m[lo:hi] = train.diloco_outer_momentum * m[lo:hi] + delta
            start[lo:hi] -= train.diloco_outer_lr * (delta + train.diloco_outer_momentum * m[lo:hi])
            for theta in thetas:
                theta[lo:hi] = alpha * theta[lo:hi] + (1 - alpha) * start[lo:hi] if tau else start[lo:hi]
    return np.array(losses), thetas


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("streaming", [dict(diloco_fragments=1), dict(diloco_fragments=2),
                                       dict(diloco_fragments=3, diloco_overlap_steps=2)], ids=["F1", "F2", "F3-tau2"])
def test_streaming_diloco_equals_the_outer_steps_taken_by_hand(streaming):
    """F = 1, τ = 0 is DiLoCo; F fragments staggered, τ steps in flight and merged with
    α = 0.5: seven steps of AdamW inside, Nesterov outside, H = 3, losses and parameters."""
    train = tiny_train(diloco_replicas=2, diloco_inner_steps=3, **streaming)
    trainer = diloco_trainer(train, Mesh(1, 1, 2))
    losses, _, _, _ = run(trainer, 7)
    ref_losses, ref_theta = by_hand(train, 7)
    mine = ref_theta[MPI.COMM_WORLD.rank]                     # rank k is replica k
    assert_close_on_every_rank({"loss": rel_diff(losses, ref_losses),
                                "params": rel_diff(held_slice(trainer.optimizer), mine)}, EQUIV_RTOL_FLOAT64)


@pytest.mark.parametrize("fragments", [2, 3])
def test_one_replica_in_fragments_with_unit_outer_lr_is_plain_training(fragments):
    train = dict(optimizer="adamw", global_batch_size=4)
    streaming = tiny_train(**train, diloco_replicas=1, diloco_inner_steps=3, diloco_fragments=fragments,
                           diloco_outer_lr=1.0, diloco_outer_momentum=0.0)
    losses, _, params, _ = run(make_trainer(MODEL, streaming, Topology.serial()), 7)
    ref_losses, _, ref_params, _ = serial_reference(MODEL, tiny_train(**train), steps=7)
    assert rel_diff(losses, ref_losses) <= EQUIV_RTOL_FLOAT64 and param_diff(params, ref_params) <= EQUIV_RTOL_FLOAT64


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("outer_dtype", ["fp32", "bf16", "int8", "int4"])
def test_each_step_sends_one_fragment_in_the_formulas_bytes(outer_dtype):
    """F = 2 of H = 4: fragment 0 leaves after steps 4, 8, fragment 1 after 2, 6; each
    time 2 (R-1)/R · S/F · b (fp32), half that (bf16), or (R-1)(n + ⌈n/CHUNK⌉ b) (int8):
    the peak per step is the whole stage's bytes / F, and a round moves the whole stage."""
    train = tiny_train(diloco_replicas=2, diloco_inner_steps=4, diloco_fragments=2, diloco_outer_dtype=outer_dtype)
    trainer = diloco_trainer(train, Mesh(1, 1, 2))
    store = trainer.optimizer.store
    sent = []
    for _ in range(8):
        trainer.topo.stats.reset()
        sent.append(trainer.train_step(tiny_tokens())["diloco_bytes"])
    sizes = [hi - lo for lo, hi in (balanced_bounds(store.size, 2, p) for p in range(2))]
    b = store.dtype.itemsize
    each = {"fp32": [n * b for n in sizes], "bf16": [n * 2 for n in sizes],
            "int8": [message_bytes(n, b) for n in sizes], "int4": [message_bytes(n, b, "int4") for n in sizes]}[outer_dtype]
    assert sent == [0, each[1], 0, each[0]] * 2
    if outer_dtype == "fp32":
        assert max(sent) * 2 <= store.size * b + b and sum(sent[:4]) == store.size * b


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("outer_dtype", ["bf16", "int8", "int4"])
def test_low_formats_change_the_run_by_their_rounding_only(outer_dtype):
    """bf16 and int8 pseudo-gradients move the parameters away from fp32's (the
    assertion could fail), by about the formats' relative precision."""
    runs = [run(diloco_trainer(tiny_train(diloco_replicas=2, diloco_inner_steps=2, diloco_outer_dtype=dtype),
                               Mesh(1, 1, 2)), 4)[3] for dtype in ("fp32", outer_dtype)]
    exact, low = (held_slice(t.optimizer) for t in runs)
    moved = np.abs(low - exact).max() / np.abs(exact).max()
    assert_close_on_every_rank({"moved": moved}, 1e-2)
    assert moved > 1e-6


@pytest.mark.parametrize("kind, levels", [("int8", 127), ("int4", 7)])
def test_packing_errs_by_half_a_step_of_its_chunk(kind, levels):
    x = np.random.default_rng(0).standard_normal(2 * CHUNK + 5) * np.repeat([1e-3, 1.0, 10.0], [CHUNK, CHUNK, 5])
    packed = pack(x, kind)
    assert packed.size == message_bytes(x.size, 8, kind)
    err = np.abs(unpack(packed, x.size, x.dtype, kind) - x)
    for lo, hi in ((0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, x.size)):
        assert err[lo:hi].max() <= np.abs(x[lo:hi]).max() / levels / 2 * (1 + 1e-12)
        assert err[lo:hi].max() > np.abs(x[lo:hi]).max() / levels / 8       # it did round


@pytest.mark.parallel(nprocs=2)
def test_a_streaming_run_resumes_with_an_exchange_in_flight_bit_for_bit(shared_dir):
    """F = 3, H = 3, τ = 1, int8: saved after step 4, when fragment 1 left and has not
    landed (the checkpoint completes its collective and keeps the mean that arrived),
    resumed by fresh trainers: the same losses and parameters, bit for bit."""
    from numpitron.checkpoint import load_checkpoint, save_checkpoint
    train = tiny_train(diloco_replicas=2, diloco_inner_steps=3, diloco_fragments=3, diloco_overlap_steps=1,
                       diloco_outer_dtype="int8")
    tokens = tiny_tokens()
    whole = diloco_trainer(train, Mesh(1, 1, 2))
    expected = [whole.train_step(tokens)["train_loss"] for _ in range(10)]
    first = diloco_trainer(train, Mesh(1, 1, 2))
    for _ in range(4):
        first.train_step(tokens)
    assert [e.fragment for e in first.optimizer.adam.in_flight] == [1]
    path = save_checkpoint(shared_dir / f"replica-{first.topo.replicas.index}", first)
    resumed = diloco_trainer(train, Mesh(1, 1, 2))
    load_checkpoint(path, resumed)
    assert resumed.optimizer.adam.received.any()
    losses = [resumed.train_step(tokens)["train_loss"] for _ in range(6)]
    assert losses == expected[4:] and not whole.optimizer.adam.in_flight
    assert np.array_equal(resumed.optimizer.store.data, whole.optimizer.store.data)
    assert np.array_equal(resumed.optimizer.adam.momentum, whole.optimizer.adam.momentum)


@pytest.mark.parametrize("flags, message", [
    (dict(diloco_fragments=2), "--diloco-fragments set DiLoCo: give --diloco-replicas too"),
    (dict(diloco_replicas=2, diloco_inner_steps=2, diloco_fragments=3), "must not exceed --diloco-inner-steps"),
    (dict(diloco_replicas=2, diloco_inner_steps=2, diloco_overlap_steps=2), "must be below --diloco-inner-steps"),
    (dict(diloco_replicas=2, diloco_merge_alpha=1.5), "must lie in \\[0, 1\\]"),
    (dict(diloco_replicas=2, diloco_outer_dtype="fp4"), "unknown --diloco-outer-dtype")])
def test_streaming_settings_are_checked_in_one_line(flags, message):
    from numpitron.errors import UserError
    with pytest.raises(UserError, match=message):
        tiny_train(**flags)


def test_the_settings_are_training_flags_and_file_keys():
    """Declared in diloco/settings.py, they are TrainConfig's: flags and [training] keys."""
    from numpitron.config import TrainConfig
    from numpitron.config_fields import flags_of
    keys = {flag.key for flag in flags_of(TrainConfig)}
    assert {"diloco_replicas", "diloco_fragments", "diloco_overlap_steps", "diloco_outer_dtype"} <= keys
    assert TrainConfig.SECTION == "training"


def test_a_streaming_run_cut_with_an_exchange_in_flight_resumes_from_the_command_line(data_dir, tmp_path):
    """Two ranks, H = 4, F = 2, τ = 1, int8: the checkpoint of iteration 6 is taken just
    after fragment 1 left; keeping only it, as if the run had stopped there, --resume
    logs the losses of the uninterrupted run."""
    import shutil

    from tests.harness import logged_losses, train_script
    full, cut = tmp_path / "full", tmp_path / "cut"
    flags = ["--data-parallel-size", "2", "--diloco-replicas", "2", "--diloco-inner-steps", "4", "--diloco-fragments",
             "2", "--diloco-overlap-steps", "1", "--diloco-outer-dtype", "int8", "--max-iters", "10",
             "--save-interval", "6", "--keep-checkpoints", "10"]
    assert train_script(data_dir, full, *flags, nprocs=2).returncode == 0
    assert train_script(data_dir, cut, *flags, nprocs=2).returncode == 0
    replicas = sorted((cut / "checkpoints").glob("replica-*"))
    assert len(replicas) == 2
    for replica in replicas:
        for checkpoint in replica.glob("iter_*"):
            if checkpoint.name != "iter_000006":
                shutil.rmtree(checkpoint)
        (replica / "latest").unlink()
    resumed = train_script(data_dir, cut, *flags, "--resume", nprocs=2)
    assert resumed.returncode == 0, resumed.stderr
    assert logged_losses(cut) == logged_losses(full)
