"""Helpers shared by the whole suite: tiny configs, a trainer on any mesh, k-step
runs to compare with one process, and asserting on every rank at once."""

import numpy as np
from mpi4py import MPI

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig, check_layout
from numpitron.distributed.gather import gather_stores
from numpitron.distributed.topology import Topology
from numpitron.trainer import Trainer

# vocab 65 pads to 68 at tp=4, so padding is exercised; 4 layers split over pp=2, 4.
TINY = dict(vocab_size=65, seq_len=16, n_layers=4, n_heads=4, d_model=32)
SMALLER = dict(n_layers=2, n_heads=2)        # for tests that train or save many times


def tiny_model(dtype="float64", **overrides) -> ModelConfig:
    return ModelConfig(dtype=dtype, **{**TINY, **overrides}).validate()


def tiny_train(**overrides) -> TrainConfig:
    base = dict(micro_batch_size=2, global_batch_size=8, max_iters=10, lr=1e-2, min_lr=1e-3,
                warmup_iters=2, weight_decay=0.1, grad_clip=1.0, seed=7)
    return TrainConfig(**{**base, **overrides}).validate()


def tiny_tokens(n=6000, vocab=65, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16)


def make_trainer(model_cfg=None, train_cfg=None, topo=None, tensor=1, pipeline=1, data=None, context=1,
                 expert=1, **parallel) -> Trainer:
    """A Trainer on `topo`, or on a mesh of the world's ranks; `parallel` holds
    ParallelConfig fields (schedule, zero_stage, ...). Checked like the CLI checks."""
    model_cfg, train_cfg = model_cfg or tiny_model(), train_cfg or tiny_train()
    parallel_cfg = ParallelConfig(**parallel).validate()
    topo = topo or Topology.from_world(tensor, pipeline, data, context=context, expert=expert,
                                       ulysses=parallel_cfg.ulysses_group(context))
    check_layout(model_cfg, train_cfg, topo.mesh, parallel_cfg)
    return Trainer(model_cfg, parallel_cfg, train_cfg, topo)


def train_steps(trainer, steps: int, tokens=None) -> list[float]:
    """The losses of `steps` training iterations."""
    tokens = tiny_tokens() if tokens is None else tokens
    return [trainer.train_step(tokens)["train_loss"] for _ in range(steps)]


def run(trainer, steps=10, tokens=None):
    """Train `steps` iterations; returns (losses, grad norms, full params on rank 0
    else None, trainer)."""
    tokens = tiny_tokens() if tokens is None else tokens
    steps_out = [trainer.train_step(tokens) for _ in range(steps)]
    losses, norms = [s["train_loss"] for s in steps_out], [s["grad_norm"] for s in steps_out]
    full = gather_stores(trainer.model, trainer.topo,
                         [{"params": optimizer.full_params()} for optimizer in trainer.optimizers])
    return np.array(losses), np.array(norms), (full or {}).get("params"), trainer


def serial_reference(model_cfg, train_cfg, steps=10, tokens=None):
    return run(make_trainer(model_cfg, train_cfg, Topology.serial()), steps, tokens)


def assert_on_every_rank(checks: dict) -> None:
    """checks: {name: bool, or (measured, expected) that must be equal}. Every rank
    learns every rank's failures before asserting, so all ranks fail together instead
    of one failing while the others wait in the next collective."""
    def bad(value):
        return not value if isinstance(value, (bool, np.bool_)) else value[0] != value[1]
    failures = {f"rank {r}: {name}": value for r, c in enumerate(MPI.COMM_WORLD.allgather(checks))
                for name, value in c.items() if bad(value)}
    assert not failures, failures


def assert_close_on_every_rank(diffs: dict, rtol: float) -> None:
    """diffs: {name: relative difference}; the worst over all ranks must be <= rtol."""
    everyone = MPI.COMM_WORLD.allgather(diffs)
    worst = {k: max(d.get(k, 0.0) for d in everyone) for k in set().union(*everyone)}
    assert max(worst.values(), default=0.0) <= rtol, worst


def identical_over(comm, array) -> bool:
    copies = comm.mpi.allgather(array)
    return all(np.array_equal(c, copies[0]) for c in copies)
