"""The memory one rank needs, checked before anything large is allocated, so that an
impossible size is one line instead of a MemoryError."""

import contextlib
import os

import numpy as np

from numpitron.errors import UserError


def available_bytes() -> int | None:
    """MemAvailable of this host (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@contextlib.contextmanager
def _beyond_any_host(what: str = "this configuration"):
    """Sizes so large that the accounting's floats overflow (10^400 experts) need more
    memory than any host has: the one-line refusal, not an OverflowError."""
    try:
        yield
    except OverflowError:
        raise UserError(f"{what} needs more memory than any host has (its sizes overflow the accounting): "
                        f"use smaller sizes") from None


def check_fits(model_cfg, parallel_cfg, train_cfg, topo) -> None:
    """This rank's parameters, gradients, optimizer state and peak activations, from the
    planner's accounting (numpitron/plan/accounting.py, exact on every tested layout),
    against what this host has free."""
    from numpitron.plan.accounting import Rank, state_bytes
    from numpitron.plan.activations import peak_activation_bytes
    rank = Rank.of(topo, parallel_cfg)
    with _beyond_any_host():
        need = sum(state_bytes(model_cfg, parallel_cfg, rank, train_cfg.optimizer).values()) \
            + peak_activation_bytes(model_cfg, parallel_cfg, train_cfg, rank)
    have = available_bytes()
    if have is not None and need > have:
        raise UserError(f"this configuration needs about {need / 2**30:.1f} GiB per rank, and this host has "
                        f"{have / 2**30:.1f} GiB available: use smaller sizes or more ranks")


def check_model_fits(model_cfg, topo, parameter_copies: int = 0, what: str = "this model") -> None:
    """Before building a GPTStage: its buffers (parameters, gradients and two masks, four
    times the parameters, as the optimizer's state counts them) and `parameter_copies`
    more copies of its parameters, against what this host has free. A model config
    read from a file is checked so before anything is allocated."""
    from numpitron.config import ParallelConfig
    from numpitron.plan.accounting import Rank, state_bytes
    parallel = ParallelConfig()
    with _beyond_any_host(what):
        state = state_bytes(model_cfg, parallel, Rank.of(topo, parallel))
    need = sum(state.values()) + parameter_copies * state["params"]
    have = available_bytes()
    if have is not None and need > have:
        raise UserError(f"{what} needs about {need / 2**30:.1f} GiB per rank, and this host has "
                        f"{have / 2**30:.1f} GiB available")


def generation_bytes(model_cfg, topo, num_samples: int, length: int) -> int:
    """About what generating `num_samples` sequences of `length` tokens keeps on one rank:
    every replica's token ids and this replica's growing copy (int64), its blocks'
    key/value cache, and a prefill's widest activations and logits, a few alive at once."""
    rows, item = -(-num_samples // topo.dp), np.dtype(model_cfg.dtype).itemsize
    T, C, V = model_cfg.seq_len, model_cfg.d_model, model_cfg.vocab_size
    blocks = -(-model_cfg.n_layers // topo.pp)
    ids = 8 * rows * length * (topo.dp + 2)
    cache = 2 * blocks * rows * T * (C // topo.tp) * item
    prefill = 4 * rows * T * (4 * C + V) * item
    return ids + cache + prefill


def check_generation_fits(model_cfg, topo, num_samples: int, length: int) -> None:
    need, have = generation_bytes(model_cfg, topo, num_samples, length), available_bytes()
    if have is not None and need > have:
        raise UserError(f"generating {num_samples} samples of {length} tokens needs about {need / 2**30:.1f} GiB "
                        f"per rank, and this host has {have / 2**30:.1f} GiB available: ask for fewer or shorter")
