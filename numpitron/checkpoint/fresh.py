"""A checkpoint that no training run wrote: the one-process model a config describes, and
a checkpoint at iteration 0 holding given weights. Both imports end here (convert.py's
`.npz`, huggingface.py's GPT-2 directory)."""

from pathlib import Path

import numpy as np

from numpitron.checkpoint.save import write_serial_checkpoint
from numpitron.checkpoint.sharded import cut_range
from numpitron.config import ParallelConfig, to_dict
from numpitron.distributed.gather import saved_params
from numpitron.errors import UserError
from numpitron.memory import check_model_fits


def serial_model(model_cfg, what: str, twice: bool = False):
    """(the one-process model of `model_cfg`, {name: logical shape} of every tensor its
    checkpoint holds), after checking that it fits in memory (`twice`: with a second
    copy of its parameters beside it). It communicates with nobody."""
    from numpitron.distributed.topology import Topology
    from numpitron.build import build_stage
    topo = Topology.serial()
    check_model_fits(model_cfg, topo, parameter_copies=int(twice), what=what)
    model = build_stage(model_cfg, topo)
    return model, {p.name: p.logical_shape for store in model.stores for p in saved_params(model, store)}


def write_fresh_checkpoint(root: Path, model_cfg, arrays: dict, imported_from: str, model=None, **fields) -> Path:
    """A checkpoint at iteration 0 with zero Adam state in ROOT, holding `arrays` (full
    logical tensors by name, already checked against the model); ROOT/latest then points
    at it. `fields` adds to its manifest (the tokenizer, for one). Both imports end here."""
    model = model or serial_model(model_cfg, f"importing {imported_from}")[0]
    sources = []
    for store in model.stores:
        params = cut_range(store, 0, store.size, lambda name, shape: arrays[name].astype(store.dtype))
        zeros = np.zeros(store.size, store.dtype)
        sources.append((store, saved_params(model, store), 0, {"params": params, "adam_m": zeros, "adam_v": zeros}))
    fields = {
        "model_config": to_dict(model_cfg),
        "parallel_config": to_dict(ParallelConfig()),
        "mesh": None,                   # not written by a training run
        "train_config": None,           # unknown: an import has weights only
        "iteration": 0,
        "adam_step": 0,
        "best_val_loss": None,
        "seed": None,
        "data_state": {"sampler": "seeded-per-iteration", "seed": None, "next_iteration": 0},
        "imported_from": imported_from,
        **fields,
    }
    try:
        return write_serial_checkpoint(root, 0, fields, sources)
    except OSError as error:
        raise UserError(f"cannot write a checkpoint in {root}: {error.strerror or error}") from None


def few(names: list[str], shown: int = 3) -> str:
    """A short list for a one-line message."""
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
