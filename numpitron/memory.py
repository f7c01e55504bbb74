"""The memory one rank needs, checked before anything large is allocated, so that an
impossible size is one line instead of a MemoryError."""

import os

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


def check_fits(model_cfg, parallel_cfg, train_cfg, topo) -> None:
    """This rank's parameters, gradients, optimizer state and peak activations, from the
    planner's accounting (numpitron/plan/accounting.py, exact on every tested layout),
    against what this host has free."""
    from numpitron.plan.accounting import Rank, peak_activation_bytes, state_bytes
    rank = Rank(topo.tp, topo.pp, topo.dp, topo.cp, topo.pp_rank, topo.cp_rank, topo.dp_rank)
    need = sum(state_bytes(model_cfg, parallel_cfg, rank, train_cfg.optimizer).values()) \
        + peak_activation_bytes(model_cfg, parallel_cfg, train_cfg, rank)
    have = available_bytes()
    if have is not None and need > have:
        raise UserError(f"this configuration needs about {need / 2**30:.1f} GiB per rank, and this host has "
                        f"{have / 2**30:.1f} GiB available: use smaller sizes or more ranks")
