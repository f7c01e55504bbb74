"""The same GPT in PyTorch (eager), timed the way benchmark.py times numpitron.

    python benchmarks/torch_reference.py --threads 1 --n-layers 4 --d-model 128 ...

A yardstick only: the library never imports PyTorch (install it with the `bench`
extra). The model matches numpitron's (pre-LayerNorm blocks, tanh GELU, causal
attention through scaled_dot_product_attention, LM head tied to the token embedding,
AdamW with decay on matrices and embeddings only, global-norm clipping), so both train
the same number of FLOPs per token. Prints one JSON object.
"""

import argparse
import json
import resource
import time


def build(args, torch):
    nn, F = torch.nn, torch.nn.functional
    C, H = args.d_model, args.n_heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.fc, self.out = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(heads.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(args.vocab, C), nn.Embedding(args.seq_len, C)
            self.blocks = nn.ModuleList(Block() for _ in range(args.n_layers))
            self.ln_f = nn.LayerNorm(C)

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.tok.weight.T
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))
    return model, opt


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--threads", 1), ("--n-layers", 4), ("--n-heads", 4), ("--d-model", 128),
                          ("--seq-len", 64), ("--batch", 12), ("--vocab", 65), ("--warmup", 5), ("--iters", 30)):
        p.add_argument(flag, type=int, default=default)
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, opt = build(args, torch)
    tokens = torch.randint(0, args.vocab, (200_000,))
    gen = torch.Generator().manual_seed(1)

    def step():
        starts = torch.randint(0, len(tokens) - args.seq_len - 1, (args.batch,), generator=gen)
        window = torch.stack([tokens[s:s + args.seq_len + 1] for s in starts.tolist()])
        loss = model(window[:, :-1], window[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    ms = times[len(times) // 2] * 1e3
    print(json.dumps({"framework": f"pytorch {torch.__version__}", "threads": args.threads,
                      "ms_per_iter_median": round(ms, 2),
                      "tokens_per_s": round(args.batch * args.seq_len / (ms / 1e3), 1),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


if __name__ == "__main__":
    main()
