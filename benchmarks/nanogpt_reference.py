"""The yardstick: nanoGPT's GPT and training loop in PyTorch (eager), timed like benchmark.py.

    python benchmarks/nanogpt_reference.py --threads 1            # the default model
    python benchmarks/nanogpt_reference.py --n-layers 6 --n-heads 6 --d-model 384 --seq-len 256 --batch 8

A yardstick only, outside the library (numpitron never imports PyTorch; install it with
the `bench` extra). It behaves as karpathy/nanoGPT's `model.py` and `train.py` do on a CPU,
written afresh so that the code a PyTorch user knows is what numpitron is measured against:

- the same modules and ops: one fused `c_attn` projection split into q, k, v;
  `scaled_dot_product_attention` with `is_causal=True`; exact (erf) GELU between `c_fc` and
  `c_proj`; LayerNorm with a bias, eps 1e-5; dropout modules at p = 0 (nanoGPT's char
  config trains with 0.2, which numpitron has no counterpart for); the LM head a bias-free
  Linear whose weight *is* the token embedding's;
- the same initialisation: every Linear and Embedding weight normal(0, 0.02), biases zero,
  the two projections into the residual stream (`c_proj`) normal(0, 0.02 / sqrt(2 n_layer));
- the same optimizer: AdamW in two groups, weight decay on every tensor of two or more
  dimensions and none on biases and LayerNorm gains, no `fused` on a CPU;
- the same loop: set each group's lr from warm-up and cosine decay, forward returning
  (logits, loss), fetch the next batch, backward, clip the global norm at 1, step,
  `zero_grad(set_to_none=True)`; batches drawn as nanoGPT's `get_batch` draws them (one
  random start per row, stacked from a uint16 token array).

Numpitron differs in one op: its GELU is GPT-2's tanh form, nanoGPT's is PyTorch's
default erf form; both train the same FLOPs per token. Prints one JSON object.
"""

import argparse
import json
import math
import re
import resource
import time

import numpy as np


def define_gpt(torch):
    """nanoGPT's module tree; returns the GPT class (torch is imported by the caller)."""
    nn, F = torch.nn, torch.nn.functional

    class LayerNorm(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(width))
            self.bias = nn.Parameter(torch.zeros(width))

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

    class CausalSelfAttention(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
            self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
            self.resid_dropout = nn.Dropout(cfg.dropout)
            self.n_heads, self.width, self.dropout = cfg.n_heads, cfg.d_model, cfg.dropout

        def forward(self, x):
            B, T, C = x.shape
            heads = [t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
                     for t in self.c_attn(x).split(self.width, dim=2)]
            y = F.scaled_dot_product_attention(*heads, attn_mask=None, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
            return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))

    class MLP(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
            self.dropout = nn.Dropout(cfg.dropout)

        def forward(self, x):
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

    class Block(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.ln_1, self.attn = LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
            self.ln_2, self.mlp = LayerNorm(cfg.d_model), MLP(cfg)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(cfg.vocab, cfg.d_model),
                wpe=nn.Embedding(cfg.seq_len, cfg.d_model),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers)),
                ln_f=LayerNorm(cfg.d_model)))
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight        # weight tying
            self.apply(self._init_weights)
            for name, param in self.named_parameters():
                if name.endswith("c_proj.weight"):                   # GPT-2's scaled residual init
                    nn.init.normal_(param, 0.0, 0.02 / math.sqrt(2 * cfg.n_layers))

        @staticmethod
        def _init_weights(module):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

        def forward(self, idx, targets):
            positions = torch.arange(idx.shape[1], dtype=torch.long)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return logits, loss

    return GPT


def adamw(model, torch, lr: float, weight_decay: float, betas: tuple[float, float]):
    """nanoGPT's two groups: decay every tensor with dim >= 2, none on the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


class Together:
    """Several torch optimizers stepped as one: Muon's on the hidden matrices, AdamW's on the rest."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers
        self.param_groups = [group for opt in optimizers for group in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def muon_and_adamw(model, torch, lr: float, weight_decay: float, betas: tuple[float, float], momentum: float = 0.95):
    """numpitron's --optimizer muon (numpitron/muon/muon.py) in torch.optim: Muon with
    Nesterov momentum, five Newton-Schulz steps and the update scaled to AdamW's RMS,
    0.2 sqrt(max(A, B)) ("match_rms_adamw", Liu et al. 2025), with decoupled weight decay,
    on every 2-D matrix of the blocks; AdamW, as `adamw` groups it, on the embeddings (the
    tied head among them), biases and LayerNorm gains. One learning rate for both."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = [p for p in params if p.dim() == 2 and id(p) not in embeddings]
    rest = [p for p in params if id(p) not in {id(h) for h in hidden}]
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True,
                            ns_steps=5, adjust_lr_fn="match_rms_adamw")
    adam = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}], lr=lr, betas=betas)
    return Together(muon, adam)


def sgemm_ceiling(torch, n: int = 1024, reps: int = 20) -> float:
    """GFLOP/s of torch.mm on n x n float32 on one thread: PyTorch's own BLAS's ceiling
    (its bundled one, not NumPy's), the yardstick of its MFU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return 2 * n ** 3 / float(np.median(times)) / 1e9


def cosine_lr(it: int, args) -> float:
    """Linear warm-up over args.lr_warmup steps, then cosine decay to lr / 10 by args.lr_decay_iters."""
    if it < args.lr_warmup:
        return args.lr * (it + 1) / (args.lr_warmup + 1)
    if it > args.lr_decay_iters:
        return args.lr / 10
    ratio = (it - args.lr_warmup) / (args.lr_decay_iters - args.lr_warmup)
    return args.lr / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


def blas_of(torch) -> str:
    """The BLAS and CPU kernels PyTorch was built with, as its own config says."""
    found = re.findall(r"(BLAS_INFO=[^,\s]+|USE_MKLDNN=[^,\s]+|CPU capability usage: \S+)", torch.__config__.show())
    return ", ".join(found)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--threads", 1), ("--n-layers", 4), ("--n-heads", 4), ("--d-model", 128),
                          ("--seq-len", 64), ("--batch", 12), ("--vocab", 65), ("--warmup", 5), ("--iters", 30),
                          ("--lr-warmup", 100), ("--lr-decay-iters", 5000)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)         # nanoGPT's shakespeare_char config
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="muon: numpitron's recipe (muon_and_adamw), for a step of the same work")
    args = p.parse_args()
    args.dropout = 0.0
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    model = define_gpt(torch)(args)
    model.train()
    opt = (muon_and_adamw if args.optimizer == "muon" else adamw)(model, torch, args.lr, weight_decay=0.1,
                                                                  betas=(0.9, 0.99))
    ceiling = sgemm_ceiling(torch)
    data = np.random.default_rng(0).integers(0, args.vocab, 200_000).astype(np.uint16)

    def get_batch():
        starts = torch.randint(len(data) - args.seq_len, (args.batch,))
        x = torch.stack([torch.from_numpy(data[i:i + args.seq_len].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.seq_len].astype(np.int64)) for i in starts])
        return x, y

    X, Y = get_batch()
    times = []
    for it in range(args.warmup + args.iters):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = cosine_lr(it, args)
        _, loss = model(X, Y)
        X, Y = get_batch()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    ms = float(np.median(times[args.warmup:])) * 1e3
    print(json.dumps({"framework": f"pytorch {torch.__version__} (nanoGPT's model and loop)",
                      "threads": args.threads, "optimizer": args.optimizer, "ms_per_iter_median": round(ms, 2),
                      "ms_per_iter_min": round(min(times[args.warmup:]) * 1e3, 2),
                      "tokens_per_s": round(args.batch * args.seq_len / (ms / 1e3), 1),
                      "final_loss": round(loss.item(), 4),
                      # torch.mm's 1024^3 float32 GFLOP/s on one thread, and this build's BLAS
                      "sgemm_gflops_1thread": round(ceiling, 1), "blas": blas_of(torch),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


if __name__ == "__main__":
    main()
