"""Checkpoint <-> single .npz archive of the model's parameters (no MPI needed).

    python -m numpitron.checkpoint.convert export CKPT_DIR OUT.npz [--force]
    python -m numpitron.checkpoint.convert import IN.npz ROOT          ROOT: no checkpoints yet
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

from numpitron.checkpoint.fresh import few, serial_model, write_fresh_checkpoint
from numpitron.checkpoint.load import manifest_model_config, open_reader
from numpitron.checkpoint.manifest import LATEST_NAME, MANIFEST_NAME, TMP_PREFIX, iter_dirs, iteration_of, read_manifest
from numpitron.config import ModelConfig, from_dict
from numpitron.errors import UserError

CONFIG_KEY = "__model_config__"


def export_npz(checkpoint_dir, out_file, overwrite: bool = False) -> Path:
    """Write the checkpoint's (verified) parameters to `out_file`, exactly that name. An
    existing file is replaced only if `overwrite`, and never one that is not a regular
    file or lies inside a checkpoint."""
    checkpoint_dir, out_file = Path(checkpoint_dir), Path(out_file)
    check_output_file(out_file, overwrite)
    manifest = read_manifest(checkpoint_dir)
    model_cfg = manifest_model_config(manifest, checkpoint_dir)
    reader = open_reader(checkpoint_dir, manifest)
    _, expected = serial_model(model_cfg, f"exporting {checkpoint_dir}", twice=True)
    held = set(reader.names("params"))
    missing, extra = sorted(expected.keys() - held), sorted(held - expected.keys())
    if missing or extra:
        raise UserError(f"corrupt checkpoint {checkpoint_dir}: its tensors do not match its model config: missing "
                        f"{few(missing)}, unexpected {few(extra)}")
    arrays = {name: np.asarray(reader.getter("params", np.dtype(model_cfg.dtype))(name, shape))
              for name, shape in expected.items()}
    arrays[CONFIG_KEY] = np.array(json.dumps(manifest["model_config"]))
    # A temporary beside the target, then a rename: no half-written archive. An open
    # file also stops np.savez from appending ".npz" to a name that lacks it.
    tmp = out_file.with_name(f"{TMP_PREFIX}{out_file.name}-{os.getpid()}")
    try:
        with open(tmp, "xb") as f:
            np.savez(f, allow_pickle=False, **arrays)
        os.replace(tmp, out_file)
    except OSError as error:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass                         # e.g. a read-only directory: nothing was created there
        raise UserError(f"cannot write {out_file}: {error.strerror or error}") from None
    return out_file


def check_output_file(out_file: Path, overwrite: bool) -> None:
    """Refuse to write inside a checkpoint (or over a checkpoint root's `latest`), to
    replace anything but a regular file, or to replace a file unless told to."""
    for directory in [out_file.parent.resolve(), *out_file.parent.resolve().parents]:
        if iteration_of(directory) is not None or (directory / MANIFEST_NAME).exists():
            raise UserError(f"refusing to write {out_file} inside checkpoint {directory}")
    if out_file.name == LATEST_NAME and iter_dirs(out_file.parent):
        raise UserError(f"refusing to write {out_file}: it is the checkpoints' pointer to the newest one")
    if out_file.is_symlink() or (out_file.exists() and not out_file.is_file()):
        raise UserError(f"refusing to replace {out_file}: it is not a regular file")
    if out_file.exists() and not overwrite:
        raise UserError(f"{out_file} exists; pass --force to replace it")


def import_npz(npz_file, root) -> Path:
    """A fresh checkpoint (iteration 0, zero Adam state) in ROOT from an archive;
    ROOT/latest then points at it. Returns the checkpoint directory. ROOT must hold no
    checkpoints: an import never rewinds a run."""
    npz_file, root = Path(npz_file), Path(root)
    if iter_dirs(root) or (root / LATEST_NAME).exists() or (root / LATEST_NAME).is_symlink():
        raise UserError(f"{root} already holds checkpoints: import into a new or empty directory")
    with _open_archive(npz_file) as archive:
        model_cfg, headers = _archive_index(npz_file, archive)
        # The model says which tensors, of which shapes, a checkpoint of this config holds;
        # the archive's headers are compared with it before a byte of data is read.
        model, expected = serial_model(model_cfg, f"importing {npz_file}", twice=True)
        missing, extra = sorted(expected.keys() - headers.keys()), sorted(headers.keys() - expected.keys())
        if missing or extra:
            raise UserError(f"{npz_file} does not match its model config: missing {few(missing)}, "
                            f"unexpected {few(extra)}")
        for name, shape in expected.items():
            found_shape, found_dtype = headers[name]
            if found_shape != shape or found_dtype.kind != "f":
                raise UserError(f"{npz_file}: {name} is {found_dtype}{list(found_shape)}, expected a float array "
                                f"of shape {list(shape)}")
        arrays = {name: archive[name] for name in expected}
    for name, array in arrays.items():
        if not np.all(np.isfinite(array)):
            raise UserError(f"{npz_file}: {name} holds NaN or infinite values; a model to train must not")
    return write_fresh_checkpoint(root, model_cfg, arrays, str(npz_file), model)


def _open_archive(npz_file: Path):
    """The archive, opened without pickle, refusing anything that is not an .npz."""
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
    except (ValueError, OSError, EOFError) as error:
        raise UserError(f"{npz_file} is not a readable .npz archive: {error}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise UserError(f"{npz_file} is a single .npy array, not an .npz archive")
    return archive


def _archive_index(npz_file: Path, archive) -> tuple:
    """(ModelConfig, {name: (shape, dtype)}) from the config entry and the arrays'
    headers alone: no array's data is read."""
    if CONFIG_KEY not in archive.files:
        raise UserError(f"{npz_file} has no {CONFIG_KEY} entry; was it written by export_npz?")
    headers = {}
    try:
        for name in archive.files:
            if name != CONFIG_KEY:
                with archive.zip.open(f"{name}.npy") as f:
                    fmt = np.lib.format
                    major, _ = fmt.read_magic(f)
                    shape, _, dtype = (fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0)(f)
                if dtype.hasobject:
                    raise UserError(f"{npz_file} holds Python objects and would need pickle; refusing to load")
                headers[name] = (tuple(shape), dtype)
        config = json.loads(str(archive[CONFIG_KEY][()]))
    except ValueError as error:
        if "allow_pickle" in str(error):
            raise UserError(f"{npz_file} holds Python objects and would need pickle; refusing to load") from None
        raise UserError(f"{npz_file} is not a readable .npz archive: {error}") from None
    except (OSError, EOFError, KeyError) as error:
        raise UserError(f"{npz_file} is not a readable .npz archive: {error}") from None
    try:
        model_cfg = from_dict(ModelConfig, config).validate(label=lambda name: f"{CONFIG_KEY}.{name}")
    except (TypeError, AttributeError) as error:
        raise UserError(f"{npz_file}: unreadable {CONFIG_KEY}: {error}") from None
    except UserError as error:
        raise UserError(f"{npz_file}: unusable {CONFIG_KEY}: {error}") from None
    return model_cfg, headers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numpitron.checkpoint.convert",
                                     description="Convert between numpitron checkpoints, .npz archives and "
                                                 "Hugging Face GPT-2 directories.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="checkpoint directory -> .npz of its parameters")
    export.add_argument("checkpoint_dir")
    export.add_argument("out_file")
    export.add_argument("--force", action="store_true", help="replace OUT.npz if it exists (a regular file only)")
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
            out = export_npz(args.checkpoint_dir, args.out_file, args.force)
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
