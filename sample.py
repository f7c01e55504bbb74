"""Sample text from a trained checkpoint, on one process or on any tp x pp x dp mesh.

    python sample.py --prompt "ROMEO:" --max-new-tokens 300
    python sample.py --config configs/sample.toml --temperature 0
    mpiexec -n 2 python sample.py --tensor-parallel-size 2
    mpiexec -n 4 python sample.py --pipeline-parallel-size 2 --data-parallel-size 2 --num-samples 4

One sample (the default) is printed as it is drawn, a token at a time, on any mesh, and
keeps only the model's window: its length costs no memory. Several samples are split over
the dp replicas and printed together once all are done.
"""

import sys
from dataclasses import dataclass
from typing import ClassVar

from numpitron.config_fields import setting
from numpitron.runtime import configure_process

configure_process(sys.argv)


@dataclass(frozen=True)
class SampleFiles:
    SECTION: ClassVar[str] = "files"        # the --help group and the section of a --config file

    out_dir: str = setting("out", "the training run's directory (uses its latest checkpoint)")
    checkpoint: str | None = setting(None, "a specific checkpoint directory instead")
    data_dir: str = setting("data", "tokenizer location if the checkpoint has none")


@dataclass(frozen=True)
class Sampling:
    SECTION: ClassVar[str] = "sampling"

    prompt: str = setting("\n")
    max_new_tokens: int = setting(500)
    temperature: float = setting(0.8, "0: greedy (the most likely token)")
    top_k: int | None = setting(None)
    seed: int = setting(1337)
    num_samples: int = setting(1, "1: printed as it is generated; more: printed together at the end")


def parser():
    from numpitron.cli import ArgumentParser, add_config_flag, add_mesh_flags
    p = ArgumentParser(description="Generate text from a numpitron checkpoint.")
    add_config_flag(p)
    add_mesh_flags(p)
    p.add_settings(SampleFiles)
    p.add_settings(Sampling)
    return p


def main(argv=None) -> int:
    import math
    from pathlib import Path

    from mpi4py import MPI

    from numpitron.checkpoint import latest_checkpoint, load_model_weights, read_manifest
    from numpitron.checkpoint.load import manifest_model_config
    from numpitron.cli import mesh_from_args
    from numpitron.data.tokenizer import CharTokenizer
    from numpitron.distributed.topology import Topology
    from numpitron.errors import UserError
    from numpitron.generate import generate, stream
    from numpitron.memory import check_generation_fits, check_model_fits
    from numpitron.build import build_stage

    args = parser().parse_args(argv)
    for name in ("max_new_tokens", "num_samples"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if not math.isfinite(args.temperature) or args.temperature < 0 or (args.top_k is not None and args.top_k < 1):
        raise UserError("--temperature must be a finite number >= 0 and --top-k positive")
    if args.seed < 0:
        raise UserError(f"--seed must not be negative, got {args.seed}")
    if not args.prompt:
        raise UserError("--prompt must not be empty")
    if args.context_parallel_size != 1:
        raise UserError("sampling generates one token at a time: leave out --context-parallel-size")
    path = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(Path(args.out_dir) / "checkpoints")
    if path is None:
        raise UserError(f"no checkpoint in {Path(args.out_dir) / 'checkpoints'}; train first or pass --checkpoint")
    manifest = read_manifest(path)
    if "tokenizer" in manifest:
        tokenizer = CharTokenizer.from_dict(manifest["tokenizer"])
    else:       # e.g. a checkpoint imported from an .npz archive
        tokenizer = CharTokenizer.load(Path(args.data_dir) / "tokenizer.json")
    prompt = tokenizer.encode(args.prompt)
    model_cfg = manifest_model_config(manifest, path)
    world = MPI.COMM_WORLD
    topo = Topology.from_mesh(world, mesh_from_args(args, world.Get_size(), model_cfg, None), args.collective_timeout)
    check_model_fits(model_cfg, topo, what=f"sampling from {path}")
    streamed = args.num_samples == 1          # kept: the window the model sees, not the text
    kept = min(args.max_new_tokens, model_cfg.seq_len) if streamed else args.max_new_tokens
    check_generation_fits(model_cfg, topo, args.num_samples, len(prompt) + kept)
    model = build_stage(model_cfg, topo)
    load_model_weights(path, model, model_cfg)
    if streamed:
        show = print if topo.is_logger else (lambda *args, **kwargs: None)     # every rank draws each token
        show(tokenizer.decode(prompt), end="", flush=True)
        for token in stream(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed):
            show(tokenizer.decode([token]), end="", flush=True)
        show(flush=True)
        return 0
    ids = generate(model, prompt, args.max_new_tokens, args.num_samples, args.temperature, args.top_k, args.seed)
    if topo.is_logger:
        print("\n---------------\n".join(tokenizer.decode(row) for row in ids), flush=True)
    return 0


if __name__ == "__main__":
    from numpitron.distributed.launch import run_main
    sys.exit(run_main(main))
