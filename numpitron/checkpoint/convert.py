"""Checkpoint <-> single .npz archive of the model's parameters (no MPI needed).

    python -m numpitron.checkpoint.convert export CKPT_DIR OUT.npz
    python -m numpitron.checkpoint.convert import IN.npz ROOT
    python -m numpitron.checkpoint.convert hf-export CKPT_DIR OUT_DIR    (huggingface.py)
    python -m numpitron.checkpoint.convert hf-import HF_DIR ROOT

The archive holds one array per parameter name (full logical tensors) and
`__model_config__`, the model config as JSON in a 0-d unicode array: everything
other tools need, and nothing that needs pickle to read.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from numpitron.checkpoint.load import open_reader
from numpitron.checkpoint.manifest import TMP_PREFIX, read_manifest
from numpitron.checkpoint.save import write_checkpoint
from numpitron.config import ModelConfig, ParallelConfig, from_dict, to_dict
from numpitron.errors import UserError

CONFIG_KEY = "__model_config__"


def export_npz(checkpoint_dir, out_file) -> Path:
    """Write the checkpoint's (verified) parameters to `out_file`, exactly that name."""
    checkpoint_dir, out_file = Path(checkpoint_dir), Path(out_file)
    manifest = read_manifest(checkpoint_dir)
    reader = open_reader(checkpoint_dir, manifest, ("params",))
    arrays = {name: np.asarray(reader.full("params", name)) for name in reader.names("params")}
    if not arrays:
        raise UserError(f"checkpoint {checkpoint_dir} holds no parameters")
    arrays[CONFIG_KEY] = np.array(json.dumps(manifest["model_config"]))
    # A temporary beside the target, then a rename: no half-written archive. An open
    # file also stops np.savez from appending ".npz" to a name that lacks it.
    tmp = out_file.with_name(f"{TMP_PREFIX}{out_file.name}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, allow_pickle=False, **arrays)
        os.replace(tmp, out_file)
    except OSError as error:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass                         # e.g. a read-only directory: nothing was created there
        raise UserError(f"cannot write {out_file}: {error.strerror or error}") from None
    return out_file


def import_npz(npz_file, root) -> Path:
    """A fresh checkpoint (iteration 0, zero Adam state) in ROOT from an archive;
    ROOT/latest then points at it. Returns the checkpoint directory."""
    npz_file, root = Path(npz_file), Path(root)
    arrays, model_cfg = _read_archive(npz_file)
    from numpitron.distributed.topology import Topology
    from numpitron.distributed.gather import saved_params
    from numpitron.model import GPTStage
    # The one-process model says which tensors, of which shapes, a checkpoint of this
    # config must hold. It communicates with nobody.
    expected = {p.name: p.logical_shape for p in saved_params(GPTStage(model_cfg, Topology.serial()))}
    missing, extra = sorted(expected.keys() - arrays.keys()), sorted(arrays.keys() - expected.keys())
    if missing or extra:
        raise UserError(f"{npz_file} does not match its model config: missing {_few(missing)}, "
                        f"unexpected {_few(extra)}")
    dtype = np.dtype(model_cfg.dtype)
    params = {}
    for name, shape in expected.items():
        array = arrays[name]
        if array.shape != shape or not np.issubdtype(array.dtype, np.floating):
            raise UserError(f"{npz_file}: {name} is {array.dtype}{list(array.shape)}, expected a float array "
                            f"of shape {list(shape)}")
        params[name] = array.astype(dtype)
    zeros = {name: np.zeros_like(a) for name, a in params.items()}
    fields = {
        "model_config": to_dict(model_cfg),
        "parallel_config": to_dict(ParallelConfig()),
        "mesh": None,                   # not written by a training run
        "train_config": None,           # unknown: the archive has weights only
        "iteration": 0,
        "adam_step": 0,
        "best_val_loss": None,
        "seed": None,
        "data_state": {"sampler": "seeded-per-iteration", "seed": None, "next_iteration": 0},
        "imported_from": str(npz_file),
    }
    try:
        return write_checkpoint(root, 0, {"params": params, "adam_m": zeros, "adam_v": dict(zeros)}, fields)
    except OSError as error:
        raise UserError(f"cannot write a checkpoint in {root}: {error.strerror or error}") from None


def _few(names: list[str], shown: int = 3) -> str:
    """A short list for a one-line message."""
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _read_archive(npz_file: Path):
    """({name: array}, ModelConfig) from an archive, refusing anything that needs pickle."""
    if not npz_file.is_file():
        raise UserError(f"archive not found: {npz_file}")
    with open(npz_file, "rb") as f:
        magic = f.read(4)
    if magic.startswith(b"\x93NUM"):
        raise UserError(f"{npz_file} is a single .npy array, not an .npz archive")
    if magic != b"PK\x03\x04":                      # an .npz is a zip archive
        raise UserError(f"{npz_file} is not an .npz archive")
    try:
        archive = np.load(npz_file, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise UserError(f"{npz_file} is a single .npy array, not an .npz archive")
        with archive:
            arrays = {name: archive[name] for name in archive.files}
    except ValueError as error:
        if "allow_pickle" in str(error):
            raise UserError(f"{npz_file} holds Python objects and would need pickle; refusing to load") from None
        raise UserError(f"{npz_file} is not a readable .npz archive: {error}") from None
    except (OSError, EOFError) as error:
        raise UserError(f"{npz_file} is not a readable .npz archive: {error}") from None
    if CONFIG_KEY not in arrays:
        raise UserError(f"{npz_file} has no {CONFIG_KEY} entry; was it written by export_npz?")
    try:
        config = json.loads(str(arrays.pop(CONFIG_KEY)[()]))
        model_cfg = from_dict(ModelConfig, config).validate()
    except (ValueError, TypeError, AttributeError) as error:
        raise UserError(f"{npz_file}: unreadable {CONFIG_KEY}: {error}") from None
    return arrays, model_cfg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numpitron.checkpoint.convert",
                                     description="Convert between numpitron checkpoints, .npz archives and "
                                                 "Hugging Face GPT-2 directories.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="checkpoint directory -> .npz of its parameters")
    export.add_argument("checkpoint_dir")
    export.add_argument("out_file")
    imp = commands.add_parser("import", help=".npz of parameters -> new checkpoint in ROOT")
    imp.add_argument("npz_file")
    imp.add_argument("root")
    from numpitron.checkpoint.huggingface import add_hf_commands, run_hf_command
    add_hf_commands(commands)
    args = parser.parse_args(argv)
    try:
        if args.command.startswith("hf-"):
            print(run_hf_command(args))
        elif args.command == "export":
            out = export_npz(args.checkpoint_dir, args.out_file)
            print(f"exported the parameters of {args.checkpoint_dir} to {out}")
        else:
            path = import_npz(args.npz_file, args.root)
            print(f"imported {args.npz_file} as checkpoint {path}")
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
