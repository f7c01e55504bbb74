"""Learning rate: linear warmup, then cosine decay to min_lr (as in nanoGPT)."""

import math


def learning_rate(iteration: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int) -> float:
    if iteration < warmup_iters:
        return lr * (iteration + 1) / (warmup_iters + 1)
    if iteration >= decay_iters:
        return min_lr
    progress = (iteration - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
