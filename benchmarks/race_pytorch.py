"""PyTorch's side of the race (benchmarks/race.py): the GPT of torch_reference.py trained
on the prepared Tiny Shakespeare, with nanoGPT's recipe or with numpitron's.

    python benchmarks/race_pytorch.py --threads 2 --iters 5000                # nanoGPT's recipe
    python benchmarks/race_pytorch.py --threads 2 --optimizer muon --lr 8e-3 --iters 1000   # numpitron's

The defaults are the baseline's recipe: 4 layers, d 128, 4 heads, T 64, batch 12, AdamW
at lr 1e-3 with 100 warm-up iterations and cosine decay to 1e-4 at the last iteration,
weight decay 0.1, betas (0.9, 0.99), clipping at 1. With --optimizer muon the blocks'
matrices take torch.optim.Muon as numpitron's --optimizer muon does (nanogpt_reference.py,
`muon_and_adamw`); race.py passes configs/race.toml's values for the equal-recipe race. Every `--eval-interval` iterations (and at the
end) it takes the mean loss of `--eval-iters` random batches of each split and prints
it as train_shakespeare.py does ("iter N: train X, val Y"), so the race reads both
programs the same way. Needs only torch and NumPy; numpitron is never imported.
"""

import argparse
import math
from pathlib import Path

import numpy as np

from nanogpt_reference import adamw, muon_and_adamw
from torch_reference import build


def learning_rate(it: int, args) -> float:
    """Linear warm-up, then cosine decay to min_lr by --lr-decay-iters (default: the last
    iteration), then min_lr (numpitron's optim/schedule.py, nanoGPT's)."""
    if it < args.warmup:
        return args.lr * (it + 1) / (args.warmup + 1)
    decay = args.lr_decay_iters or args.iters
    progress = min(1.0, (it - args.warmup) / max(1, decay - args.warmup))
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def initialise(model, n_layers: int, torch) -> None:
    """GPT-2's initialisation, as numpitron draws it: every matrix and embedding normal with
    std 0.02, the two projections into the residual stream 0.02 / sqrt(2 n_layers), biases
    zero (torch's defaults would start the loss far above log 65)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                if "ln" not in name:
                    param.zero_()
                continue
            residual = name.endswith(("proj.weight", "out.weight"))
            param.normal_(0.0, 0.02 / math.sqrt(2 * n_layers) if residual else 0.02)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--threads", 2), ("--n-layers", 4), ("--n-heads", 4), ("--d-model", 128),
                          ("--seq-len", 64), ("--batch", 12), ("--iters", 5000), ("--warmup", 100),
                          ("--eval-interval", 250), ("--eval-iters", 50), ("--seed", 1337), ("--lr-decay-iters", 0)):
        p.add_argument(flag, type=int, default=default)
    for flag, default in (("--lr", 1e-3), ("--min-lr", 1e-4), ("--weight-decay", 0.1), ("--beta1", 0.9),
                          ("--beta2", 0.99), ("--grad-clip", 1.0), ("--muon-momentum", 0.95)):
        p.add_argument(flag, type=float, default=default)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--data-dir", default="data", help="train.bin and val.bin as train_shakespeare.py prepared them")
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    splits = {name: torch.from_numpy(np.fromfile(Path(args.data_dir) / f"{name}.bin", np.uint16).astype(np.int64))
              for name in ("train", "val")}
    args.vocab = int(max(int(t.max()) for t in splits.values())) + 1
    model, _ = build(args, torch)
    initialise(model, args.n_layers, torch)
    betas = (args.beta1, args.beta2)
    opt = (muon_and_adamw(model, torch, args.lr, args.weight_decay, betas, args.muon_momentum)
           if args.optimizer == "muon" else adamw(model, torch, args.lr, args.weight_decay, betas))
    gen = torch.Generator().manual_seed(args.seed)

    def batch(split):
        tokens = splits[split]
        starts = torch.randint(0, len(tokens) - args.seq_len - 1, (args.batch,), generator=gen)
        window = torch.stack([tokens[s:s + args.seq_len + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]

    @torch.no_grad()
    def evaluate():
        return {split: float(np.mean([model(*batch(split)).item() for _ in range(args.eval_iters)]))
                for split in ("train", "val")}

    for it in range(args.iters):
        for group in opt.param_groups:
            group["lr"] = learning_rate(it, args)
        loss = model(*batch("train"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        done = it + 1
        if done % args.eval_interval == 0 or done == args.iters:
            losses = evaluate()
            print(f"iter {done}: train {losses['train']:.4f}, val {losses['val']:.4f}", flush=True)


if __name__ == "__main__":
    main()
