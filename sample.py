"""Sample text from a trained checkpoint, on one process or across tensor-parallel ranks.

    python sample.py --prompt "ROMEO:" --max-new-tokens 300
    mpiexec -n 2 python sample.py --tensor-parallel-size 2
"""

import sys

from numpitron.runtime import configure_process

configure_process(sys.argv)


def parser():
    from numpitron.cli import ArgumentParser
    p = ArgumentParser(description="Generate text from a numpitron checkpoint.")
    p.add_argument("--out-dir", default="out", help="the training run's directory (uses its latest checkpoint)")
    p.add_argument("--checkpoint", default=None, help="a specific checkpoint directory instead")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-dir", default="data", help="tokenizer location if the checkpoint has none")
    p.add_argument("--blas-threads", type=int, default=1)
    return p


def main(argv=None) -> int:
    from pathlib import Path

    from numpitron.config import ModelConfig, from_dict
    from numpitron.checkpoint import latest_checkpoint, load_model_weights, read_manifest
    from numpitron.data.tokenizer import CharTokenizer
    from numpitron.distributed.launch import world_rank_and_size
    from numpitron.distributed.topology import Topology, resolve_mesh
    from numpitron.errors import UserError
    from numpitron.generate import generate
    from numpitron.model import GPTStage

    args = parser().parse_args(argv)
    for name in ("max_new_tokens", "num_samples"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if args.temperature < 0 or (args.top_k is not None and args.top_k < 1):
        raise UserError("--temperature must be >= 0 and --top-k positive")
    if not args.prompt:
        raise UserError("--prompt must not be empty")
    _, world_size = world_rank_and_size()
    tp, _, _ = resolve_mesh(world_size, args.tensor_parallel_size, 1, 1)
    path = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(Path(args.out_dir) / "checkpoints")
    if path is None:
        raise UserError(f"no checkpoint in {Path(args.out_dir) / 'checkpoints'}; train first or pass --checkpoint")
    manifest = read_manifest(path)
    if "tokenizer" in manifest:
        tokenizer = CharTokenizer.from_dict(manifest["tokenizer"])
    else:       # e.g. a checkpoint imported from an .npz archive
        tokenizer = CharTokenizer.load(Path(args.data_dir) / "tokenizer.json")
    prompt = tokenizer.encode(args.prompt)
    model_cfg = from_dict(ModelConfig, manifest["model_config"]).validate()
    if model_cfg.n_heads % tp:
        raise UserError(f"the checkpoint's n_heads ({model_cfg.n_heads}) is not divisible by --tensor-parallel-size {tp}")
    topo = Topology.from_world(tp, 1, 1)
    model = GPTStage(model_cfg, topo)
    load_model_weights(path, model, model_cfg)
    ids = generate(model, prompt, args.max_new_tokens, args.num_samples, args.temperature, args.top_k, args.seed)
    if topo.is_logger:
        print("\n---------------\n".join(tokenizer.decode(row) for row in ids), flush=True)
    return 0


if __name__ == "__main__":
    from numpitron.distributed.launch import run_main
    sys.exit(run_main(main))
