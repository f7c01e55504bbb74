"""A rough estimate of the memory one rank needs, checked before anything large is
allocated, so that an impossible size is one line instead of a MemoryError."""

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


def estimate_bytes(model_cfg, train_cfg, topo, in_flight: int) -> int:
    """Parameters, gradients and Adam's two moments of one stage, plus the activations
    `in_flight` micro-batches keep (about 20 C + the attention scores per token and
    layer; nn/ has the exact accounting). An estimate, not a bound."""
    item = 8 if model_cfg.dtype == "float64" else 4
    C, L, T, V = model_cfg.d_model, model_cfg.n_layers, model_cfg.seq_len, model_cfg.vocab_size
    layers = L // topo.pp
    params = (12 * C * C + 13 * C) * layers // topo.tp + (V + T) * C + 2 * C
    tokens = train_cfg.micro_batch_size * T // topo.cp
    heads = model_cfg.n_heads // topo.tp
    activations = layers * tokens * (20 * C // topo.tp + heads * T) + tokens * V // topo.tp
    return item * (4 * params + in_flight * activations)


def check_fits(model_cfg, train_cfg, topo, in_flight: int) -> None:
    need, have = estimate_bytes(model_cfg, train_cfg, topo, in_flight), available_bytes()
    if have is not None and need > have:
        raise UserError(f"this configuration needs about {need / 2**30:.1f} GiB per rank, and this host has "
                        f"{have / 2**30:.1f} GiB available: use smaller sizes or more ranks")
