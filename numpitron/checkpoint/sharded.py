"""Format 2: every rank writes the part of the model it owns; any mesh reads it back.

    iter_000123/shards/rank-00003.bin   raw bytes of world rank 3's pieces, back to back
    iter_000123/manifest.json           "tensors": each tensor's logical shape, padded shape,
                                        tp split axis and dtype; "files": each shard file's
                                        size and CRC-32; "pieces": which bytes of which
                                        file hold which slice of which tensor

A rank's pieces are its optimizer's `state.save_range()` of the stage's flat buffers
(its ZeRO slice; replicas split the writing the same way), cut at parameter
boundaries. A piece's "kind" is the flat buffer it comes from (`state.buffers`). A
piece is a flat range [start, stop) of one tensor's tp-local shard (tp rank t of
tp_size): the layout the writer held, recorded so that a reader on another mesh can
rebuild the logical tensor. Each tensor is written once: a tp-replicated one by tp
rank 0, the tied embedding by the first stage only.

Reading (`ShardedReader`) memory-maps only the files that hold a tensor the rank
asks for, checking each one's CRC-32 the first time; the sizes of all files are
checked up front, so a missing or truncated shard fails on every rank alike.
"""

import math
import os
from pathlib import Path

import numpy as np

from numpitron.checksum import file_crc32
from numpitron.distributed.sharding import pad_to_multiple, shard_bounds
from numpitron.errors import UserError
from numpitron.nn.param import pad_to_full
from numpitron.optim.training_state import KNOWN_BUFFERS

SHARDS = "shards"


def shard_relpath(world_rank: int) -> str:
    return f"{SHARDS}/rank-{world_rank:05d}.bin"


def written_params(model, store, topo):
    """The parameters of `store` this rank writes: the first stage's tied embedding only,
    and a tp-replicated tensor from tp rank 0 only (the others hold the same values)."""
    from numpitron.distributed.gather import saved_params
    return [p for p in saved_params(model, store) if p.counted_on(topo.tp_rank)]


def write_rank_shard(directory: Path, trainer) -> dict:
    """Write this rank's pieces into directory/shards/ and fsync them. Returns what the
    manifest needs from this rank: its tensors' layout, its file and its pieces. Each
    store (the dense parameters, the experts) with the optimizer that shards it."""
    topo, sources = trainer.topo, []
    for store, optimizer in zip(trainer.model.stores, trainer.optimizers):
        lo, hi = optimizer.state.save_range()
        sources.append((store, written_params(trainer.model, store, topo), lo, optimizer.state.values_in_range(lo, hi)))
    return write_shard(directory, topo.rank, sources)


def write_shard(directory: Path, rank: int, sources) -> dict:
    """Write one shard file: for each (store, params, lo, {kind: values on [lo, hi) of
    the store's flat buffer}), the pieces of `params` that fall in [lo, hi)."""
    relpath, pieces, tensors, offset = shard_relpath(rank), [], {}, 0
    with open(directory / relpath, "wb") as f:
        for store, params, lo, values in sources:
            hi = lo + len(values["params"])
            for p in params:
                a, b = store.offsets[p.name]
                start, stop = max(a, lo), min(b, hi)
                if start >= stop:
                    continue
                tensors[p.name] = {"shape": list(p.logical_shape), "full_shape": list(p.full_shape),
                                   "split_axis": p.split_axis, "dtype": store.dtype.name}
                for buffer in values:                   # FLAT_BUFFERS, and Muon's momentum if kept
                    piece = np.ascontiguousarray(values[buffer][start - lo:stop - lo])
                    f.write(piece.tobytes())
                    pieces.append({"kind": buffer, "name": p.name, "tp_rank": p.tp_rank, "tp_size": p.tp_size,
                                   "start": start - a, "stop": stop - a, "file": relpath, "offset": offset})
                    offset += piece.nbytes
        f.flush()
        os.fsync(f.fileno())
    files = {relpath: {"bytes": offset, "crc32": file_crc32(directory / relpath), "rank": rank}}
    return {"tensors": tensors, "files": files, "pieces": pieces}


def merge_rank_tables(tables: list[dict]) -> dict:
    """The manifest's three tables from every rank's `write_rank_shard` result."""
    merged = {"tensors": {}, "files": {}, "pieces": []}
    for table in tables:
        merged["tensors"].update(table["tensors"])
        merged["files"].update(table["files"])
        merged["pieces"] += table["pieces"]
    return merged


class ShardedReader:
    """Serves full logical tensors of a format-2 checkpoint, reading only their pieces."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.tensors = path, manifest["tensors"]
        self.files = manifest.get("files")
        if not isinstance(self.files, dict) or not isinstance(manifest.get("pieces"), list):
            raise UserError(f"corrupt checkpoint manifest in {path}: format 2 needs files and pieces")
        check_tables(path, self.tensors, self.files, manifest["pieces"])
        self.pieces = {}
        for piece in manifest["pieces"]:
            self.pieces.setdefault((piece["kind"], piece["name"]), []).append(piece)
        for relpath, entry in self.files.items():        # every rank checks every size
            file = path / relpath
            if not file.is_file():
                raise UserError(f"corrupt checkpoint {path}: {relpath} is missing (one rank's shard)")
            if file.stat().st_size != entry.get("bytes"):
                raise UserError(f"corrupt checkpoint {path}: {relpath} has {file.stat().st_size} bytes, "
                                f"the manifest says {entry.get('bytes')} (truncated or overwritten?)")
        self.mapped = {}

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self.pieces if k == kind)

    def _file(self, relpath: str) -> np.ndarray:
        """The shard's bytes, memory-mapped, after its checksum passed (once per file)."""
        if relpath not in self.mapped:
            if relpath not in self.files:
                raise UserError(f"corrupt checkpoint manifest in {self.path}: a piece names unknown file {relpath}")
            if file_crc32(self.path / relpath) != self.files[relpath].get("crc32"):
                raise UserError(f"corrupt checkpoint {self.path}: {relpath} fails its crc32 checksum")
            size = self.files[relpath]["bytes"]
            self.mapped[relpath] = (np.memmap(self.path / relpath, np.uint8, "r") if size
                                    else np.zeros(0, np.uint8))
        return self.mapped[relpath]

    def full(self, kind: str, name: str, shape: tuple | None = None) -> np.ndarray:
        """The logical tensor `name` of `kind`, rebuilt from the writers' tp shards.
        `shape`: what the model expects, compared before anything is allocated."""
        meta = self.tensors.get(name)
        pieces = self.pieces.get((kind, name), [])
        if meta is None or not pieces:
            raise UserError(f"corrupt checkpoint {self.path}: it holds no {kind} of {name}")
        if shape is not None and tuple(meta["shape"]) != tuple(shape):
            raise UserError(f"checkpoint does not fit this model: {name} has shape {tuple(meta['shape'])}, "
                            f"expected {tuple(shape)}")
        dtype, full_shape, axis = np.dtype(meta["dtype"]), tuple(meta["full_shape"]), meta["split_axis"]
        full = np.zeros(full_shape, dtype)
        # check_tables has proved that the pieces of each tp shard tile it exactly.
        for tp_rank, tp_size in sorted({(p["tp_rank"], p["tp_size"]) for p in pieces}):
            index = [slice(None)] * len(full_shape)
            if axis is not None:
                index[axis] = slice(*shard_bounds(full_shape[axis], tp_size, tp_rank))
            local = full[tuple(index)].copy()
            flat = local.reshape(-1)
            for p in pieces:
                if (p["tp_rank"], p["tp_size"]) == (tp_rank, tp_size):
                    raw = self._file(p["file"])[p["offset"]:p["offset"] + (p["stop"] - p["start"]) * dtype.itemsize]
                    flat[p["start"]:p["stop"]] = raw.view(dtype)
            full[tuple(index)] = local
        return full[tuple(slice(0, n) for n in meta["shape"])]

    def getter(self, kind: str, dtype):
        """get(name, shape) -> the full logical tensor, cast to `dtype`."""
        def get(name, shape=None):
            array = self.full(kind, name, shape).astype(dtype, copy=False)
            if not np.all(np.isfinite(array)):
                raise UserError(f"corrupt checkpoint {self.path}: {kind} {name} holds NaN or infinite values; "
                                f"refusing to load it")
            return array
        return get


PIECE_FIELDS = {"kind": str, "name": str, "tp_rank": int, "tp_size": int, "start": int, "stop": int,
                "file": str, "offset": int}


def check_tables(path: Path, tensors: dict, files: dict, pieces: list) -> None:
    """Every entry of the three tables well-formed and consistent with the others, so that
    reading can trust them: float dtypes, shapes, pieces inside their tensor and file."""
    def bad(what: str):
        raise UserError(f"corrupt checkpoint manifest in {path}: {what}")
    sizes, ranges, tp_sizes = {}, {}, {}
    for name, meta in tensors.items():
        try:
            dtype, shape, full = np.dtype(meta["dtype"]), list(meta["shape"]), list(meta["full_shape"])
        except (KeyError, TypeError, ValueError):
            bad(f"tensor {name} has no valid dtype and shapes")
        if dtype.kind != "f":
            bad(f"tensor {name} has dtype {dtype}; only floats are stored")
        if not all(isinstance(n, int) and n >= 0 for n in shape + full) or len(shape) != len(full) \
                or any(a > b for a, b in zip(shape, full)):
            bad(f"tensor {name} has shape {shape} inside {full}")
        axis = meta.get("split_axis")
        if axis is not None and (not isinstance(axis, int) or not 0 <= axis < len(full)):
            bad(f"tensor {name} has split axis {axis!r}")
        sizes[name] = (int(np.prod(full)), full[axis] if axis is not None else None, dtype.itemsize)
    for relpath, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
                or Path(relpath).is_absolute() or ".." in Path(relpath).parts:
            bad(f"file entry {relpath!r} is not a shard of this checkpoint")
    for piece in pieces:
        if not isinstance(piece, dict) or any(type(piece.get(k)) is not t for k, t in PIECE_FIELDS.items()):
            bad(f"a piece lacks one of {', '.join(PIECE_FIELDS)}")
        if piece["kind"] not in KNOWN_BUFFERS or piece["name"] not in tensors or piece["file"] not in files:
            bad(f"a piece names an unknown kind, tensor or file: {piece['kind']} {piece['name']} {piece['file']}")
        total, split, itemsize = sizes[piece["name"]]
        tp_size, tp_rank = piece["tp_size"], piece["tp_rank"]
        if tp_size < 1 or not 0 <= tp_rank < tp_size or (split is not None and split % tp_size):
            bad(f"a piece of {piece['name']} is on tp rank {tp_rank} of {tp_size}")
        local = total // tp_size if split is not None else total
        if not 0 <= piece["start"] < piece["stop"] <= local or piece["offset"] < 0 \
                or piece["offset"] + (piece["stop"] - piece["start"]) * itemsize > files[piece["file"]]["bytes"]:
            bad(f"a piece of {piece['name']} lies outside its tensor or its file")
        shard = tp_rank if split is not None else 0        # a replicated tensor is one shard
        ranges.setdefault((piece["kind"], piece["name"]), {}).setdefault(shard, []).append(
            (piece["start"], piece["stop"]))
        tp_sizes.setdefault((piece["kind"], piece["name"]), set()).add(tp_size)
    # Every checkpoint holds the parameters, and every kind of state it holds anywhere
    # (Adam's moments; with Muon its momentum; plain SGD none) it holds for every tensor.
    kinds = ("params",) + tuple(k for k in KNOWN_BUFFERS[1:] if any(kind == k for kind, _ in ranges))
    for name, meta in tensors.items():
        for kind in kinds:
            _check_coverage(bad, kind, name, meta, ranges.get((kind, name), {}), tp_sizes.get((kind, name), set()))


def _check_coverage(bad, kind: str, name: str, meta: dict, ranges: dict, tp_sizes: set) -> None:
    """The pieces of `kind` of tensor `name` tile every tp shard of it exactly: each of the
    tp ranks that wrote it, whichever stage or expert rank holds it, so that a reader on
    any rank finds a hole as every other rank does, before reading a byte."""
    shape, full, axis = meta["shape"], meta["full_shape"], meta.get("split_axis")
    if not ranges:
        bad(f"it holds no {kind} of {name}")
    if len(tp_sizes) != 1:
        bad(f"the pieces of {kind} {name} disagree on the tp size ({sorted(tp_sizes)})")
    tp = tp_sizes.pop() if axis is not None else 1
    padded = [pad_to_multiple(n, tp) if i == axis else n for i, n in enumerate(shape)]
    if full != padded:
        bad(f"tensor {name} has shape {shape} inside {full}, split over {tp} tp ranks")
    local = math.prod(full) // tp
    for shard in range(tp):
        covered, end = 0, 0
        for start, stop in sorted(ranges.get(shard, [])):
            if start < end:
                bad(f"two pieces of {kind} {name} cover the same elements")
            covered, end = covered + stop - start, stop
        if covered != local:
            where = f" on tp rank {shard} of {tp}" if axis is not None else ""
            bad(f"the pieces of {kind} {name} leave {local - covered} of its elements uncovered{where}")


def cut_range(store, lo: int, hi: int, get_full) -> np.ndarray:
    """Values on [lo, hi) of this rank's flat buffer `store` (zeros at padding), asking
    get_full(name, shape) only for the parameters that overlap the range: it returns
    the logical tensor, or raises a UserError if it has not that shape."""
    flat = np.zeros(hi - lo, store.dtype)
    for p in store.params:
        a, b = store.offsets[p.name]
        start, stop = max(a, lo), min(b, hi)
        if start >= stop:
            continue
        full = np.asarray(get_full(p.name, p.logical_shape))
        local = pad_to_full(full, p.full_shape)[p.tp_slice()].reshape(-1)
        flat[start - lo:stop - lo] = local[start - a:stop - a]
    return flat
