"""Loading checkpoints onto any mesh.

Every rank reads the files itself and asks only for the parts of its stage's flat
buffers it keeps (`optimizer.state.load`): a reader rebuilds each logical tensor those overlap
from the shards' pieces and the rank cuts its own slice out of it
(`sharded.cut_range`), so the mesh that wrote the checkpoint does not matter.
Nothing is trusted before it is checked against the manifest.
"""

import math
from dataclasses import fields
from pathlib import Path

import numpy as np

from numpitron.checkpoint.manifest import LATEST_NAME, is_complete, iter_dirs, iteration_of, read_manifest
from numpitron.checkpoint.rank_state import read_rank_state
from numpitron.checkpoint.sharded import ShardedReader, cut_range
from numpitron.config import ModelConfig
from numpitron.distributed.agree import on_every_rank
from numpitron.errors import UserError
from numpitron.precision.formats import saved_loss_scaler


def latest_checkpoint(root) -> Path | None:
    """The checkpoint ROOT/latest names if it is complete, else the newest complete
    iter_ directory, else None."""
    root = Path(root)
    try:
        name = (root / LATEST_NAME).read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    # Only a bare iter_ name is followed: the pointer must not lead outside ROOT.
    if name and name == Path(name).name and iteration_of(Path(name)) is not None and is_complete(root / name):
        return root / name
    complete = [p for p in iter_dirs(root) if is_complete(p)]
    return complete[-1] if complete else None


def load_checkpoint(path, trainer) -> dict:
    """Restore parameters, Adam state, iteration and best validation loss into
    `trainer`, whatever its mesh. Called by every rank; returns the manifest."""
    return on_every_rank(trainer.topo.world, lambda: _load_training_state(Path(path), trainer))


def load_model_weights(path, model, expected_model_cfg=None) -> dict:
    """Parameters only (for sampling) into a GPTStage on any tensor-parallel mesh."""
    return on_every_rank(model.topo.world, lambda: _load_weights(Path(path), model, expected_model_cfg))


def manifest_model_config(manifest: dict, path) -> ModelConfig:
    """The model config a checkpoint records, checked field by field and worded as the
    manifest names them: no flag can fix a checkpoint's field."""
    saved, known = manifest["model_config"], {field.name for field in fields(ModelConfig)}
    try:
        config = ModelConfig(**{k: v for k, v in saved.items() if k in known})
        return config.validate(label=lambda name: f"model_config.{name}")
    except UserError as error:
        raise UserError(f"corrupt checkpoint manifest in {path}: {error}") from None


# (saved, loading into) dtypes that hold every saved number exactly: a float32 checkpoint
# (every precision's: mixed runs save their fp32 master weights) loads into a float64 run.
# The other way would round every weight and moment, so it stays a difference.
EXACT_DTYPES = {("float32", "float64")}


def check_model_config(manifest: dict, model_cfg: ModelConfig) -> None:
    """One UserError listing every field where the checkpoint and the flags disagree."""
    saved = manifest["model_config"]
    differing = []
    for field in fields(ModelConfig):
        stored, current = saved.get(field.name, field.default), getattr(model_cfg, field.name)
        if field.name == "dtype" and (stored, current) in EXACT_DTYPES:
            continue
        if type(stored) is not type(current):
            differing.append(f"{field.name} is {stored!r} ({type(stored).__name__}), expected a {type(current).__name__}")
        elif stored != current:
            why = " (it would round the saved weights)" if field.name == "dtype" else ""
            differing.append(f"{field.name} {stored} != {current}{why}")
    if differing:
        raise UserError(f"checkpoint model config differs from the flags: {', '.join(differing)}")


def open_reader(path: Path, manifest: dict) -> ShardedReader:
    """The reader of a checkpoint whose manifest `read_manifest` has accepted."""
    return ShardedReader(path, manifest)


def check_same_optimizer(path: Path, manifest: dict, optimizer: str) -> None:
    """Muon keeps a momentum and AdamW two moments per element: a run resumes with the
    optimizer whose state was saved (a checkpoint without the key is AdamW's)."""
    saved = (manifest.get("train_config") or {}).get("optimizer", "adamw")
    if saved != optimizer:
        raise UserError(f"{path} holds the state of --optimizer {saved}; resume it with --optimizer {saved} "
                        f"(not {optimizer})")


def _load_training_state(path: Path, trainer) -> dict:
    manifest = read_manifest(path)
    check_model_config(manifest, trainer.model_cfg)
    for key in ("iteration", "adam_step"):
        if not isinstance(manifest[key], int) or manifest[key] < 0:
            raise UserError(f"corrupt checkpoint manifest in {path}: {key} is {manifest[key]!r}")
    check_same_optimizer(path, manifest, trainer.train_cfg.optimizer)
    reader = open_reader(path, manifest)
    model = trainer.model
    bias = saved_routing_bias(manifest, model, path)
    scaler = saved_loss_scaler(manifest.get("loss_scaler"), str(path))
    amax_history = saved_amax_history(manifest, path)
    restore_rank_state = read_rank_state(path, manifest, trainer)
    # Everything is read into fresh buffers first: a failure leaves the trainer untouched.
    # Each store (the dense parameters, the experts: asked for by global index, whatever
    # ep) gets the ranges its optimizer keeps.
    wanted = [{(buffer, lo, hi): cut_range(store, lo, hi, reader.getter(buffer, store.dtype))
               for buffer, lo, hi in optimizer.state.load_ranges()}
              for store, optimizer in zip(model.stores, trainer.optimizers)]
    for optimizer, values in zip(trainer.optimizers, wanted):
        optimizer.state.load(lambda buffer, lo, hi, values=values: values[buffer, lo, hi], manifest["adam_step"])
    routing_bias(model)[...] = bias
    restore_rank_state()
    if trainer.scaler:              # a mixed-precision run's
        trainer.scaler.restore(scaler)
    if trainer.fp8:                 # another precision's run has none: it calibrates again
        trainer.fp8.load_state(amax_history)
    trainer.iteration = manifest["iteration"]
    best = manifest.get("best_val_loss")
    trainer.best_val_loss = math.inf if best is None else float(best)
    return manifest


def _load_weights(path: Path, model, expected_model_cfg) -> dict:
    manifest = read_manifest(path)
    if expected_model_cfg is not None:
        check_model_config(manifest, expected_model_cfg)
    reader = open_reader(path, manifest)
    flats = [cut_range(store, 0, store.size, reader.getter("params", store.dtype)) for store in model.stores]
    bias = saved_routing_bias(manifest, model, path)
    for store, flat in zip(model.stores, flats):
        store.data[...] = flat
    routing_bias(model)[...] = bias
    return manifest


def saved_amax_history(manifest: dict, path: Path) -> dict:
    """FP8's amax histories, {layer name: 3 rows of finite amaxes}, checked; none in a
    checkpoint of another precision or from before they were saved."""
    saved = manifest.get("fp8_amax_history") or {}
    try:
        checked = {name: np.array(rows, dtype=np.float32) for name, rows in saved.items()}
    except (AttributeError, TypeError, ValueError):
        checked = None
    if checked is None or not all(h.ndim == 2 and h.shape[0] == 3 and np.all(np.isfinite(h)) and np.all(h >= 0)
                                  for h in checked.values()):
        raise UserError(f"corrupt checkpoint manifest in {path}: fp8_amax_history is not, per layer, "
                        f"3 rows of finite amaxes")
    return checked


def routing_bias(model) -> np.ndarray:
    """The experts' balancing bias (n_layers x E), or an empty one (n_layers x 0) without
    experts: every manifest holds one, so a checkpoint's shape tells what it trained."""
    return model.experts.bias if model.experts else np.zeros((model.model_cfg.n_layers, 0))


def saved_routing_bias(manifest: dict, model, path: Path) -> np.ndarray:
    """The routers' balancing bias (experts/router.py) for `model`, the same on any mesh,
    checked; a checkpoint from before it was saved has none (zeros: what an aux-loss
    run's bias is)."""
    saved = manifest.get("moe_routing_bias")
    if saved is None:
        if model.model_cfg.moe_load_balancing == "bias" and model.model_cfg.num_experts:
            raise UserError(f"corrupt checkpoint manifest in {path}: moe_routing_bias is missing")
        return np.zeros_like(routing_bias(model))
    try:
        bias = np.array(saved, dtype=np.float64)
    except (TypeError, ValueError):
        bias = None
    if bias is None or bias.shape != routing_bias(model).shape or not np.all(np.isfinite(bias)):
        raise UserError(f"corrupt checkpoint manifest in {path}: moe_routing_bias is not "
                        f"{routing_bias(model).shape[0]} x {routing_bias(model).shape[1]} finite numbers")
    return bias
