"""Checkpoints: full logical tensors in a directory, written atomically, loadable on any mesh.

See manifest.py for the format, save.py and load.py for the collective entry points,
convert.py for the .npz exchange format.

Infrastructure, not the teaching core: it keeps a run's state safe and reads the
model's Params and the optimizers' ranges, while no layer, parallel strategy or
optimizer imports it (docs/architecture.md, "The house").
"""

from numpitron.checkpoint.load import latest_checkpoint, load_checkpoint, load_model_weights
from numpitron.checkpoint.manifest import FORMAT_VERSION, read_manifest
from numpitron.checkpoint.save import save_checkpoint

__all__ = ["FORMAT_VERSION", "export_npz", "import_npz", "latest_checkpoint", "load_checkpoint",
           "load_model_weights", "read_manifest", "save_checkpoint"]


def __getattr__(name):
    # convert is imported on first use, not here: `python -m numpitron.checkpoint.convert`
    # would otherwise find the module already imported by this package and warn.
    if name in ("export_npz", "import_npz"):
        from numpitron.checkpoint import convert
        return getattr(convert, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
