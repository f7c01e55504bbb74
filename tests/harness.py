"""Shared by the equivalence tests: a tiny model, its data, and a k-step training
run on any mesh whose losses and full parameters can be compared with one process."""

import numpy as np

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
from numpitron.distributed.gather import gather_full
from numpitron.distributed.topology import Topology
from numpitron.trainer import Trainer

# vocab 65 pads to 68 at tp=4, so padding is exercised; 4 layers split over pp=2, 4.
TINY = dict(vocab_size=65, seq_len=16, n_layers=4, n_heads=4, d_model=32)


def tiny_model(dtype="float64", **overrides) -> ModelConfig:
    return ModelConfig(dtype=dtype, **{**TINY, **overrides}).validate()


def tiny_train(**overrides) -> TrainConfig:
    base = dict(micro_batch_size=2, global_batch_size=8, max_iters=10, lr=1e-2, min_lr=1e-3,
                warmup_iters=2, weight_decay=0.1, grad_clip=1.0, seed=7)
    return TrainConfig(**{**base, **overrides}).validate()


def tiny_tokens(n=6000, vocab=65, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16)


def mesh_topology(tensor=1, pipeline=1, data=None, **_):
    return Topology.from_world(tensor, pipeline, data)


def run(model_cfg, train_cfg, topo, parallel=None, steps=10, tokens=None):
    """Train `steps` iterations; returns (losses, grad norms, full params on rank 0
    else None, trainer)."""
    parallel = (parallel or ParallelConfig()).validate(model_cfg)
    trainer = Trainer(model_cfg, parallel, train_cfg, topo)
    tokens = tiny_tokens() if tokens is None else tokens
    losses, norms = [], []
    for _ in range(steps):
        out = trainer.train_step(tokens)
        losses.append(out["train_loss"])
        norms.append(out["grad_norm"])
    full = gather_full(trainer.model, topo, {"params": trainer.model.store.data})
    return np.array(losses), np.array(norms), (full or {}).get("params"), trainer


def serial_reference(model_cfg, train_cfg, steps=10, tokens=None):
    return run(model_cfg, train_cfg, Topology.serial(), None, steps, tokens)
