"""Helpers shared by the whole suite, defined once: tiny configs, a trainer on any mesh,
k-step runs compared with one process, asserting on every rank at once, and the
training script run as a user runs it (one layer's checks: tests/layer_checks.py).
Test modules import from here, never from each other."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
from numpitron.layout import check_layout
from numpitron.distributed.gather import gather_stores
from numpitron.distributed.topology import Topology
from numpitron.optim.training_state import FLAT_BUFFERS
from numpitron.rundir import LOCK_NAME
from numpitron.build import build_trainer
from numpitron.trainer import Trainer
from tests.conftest import REPO
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

# vocab 65 pads to 68 at tp=4, so padding is exercised; 4 layers split over pp=2, 4.
TINY = dict(vocab_size=65, seq_len=16, n_layers=4, n_heads=4, d_model=32)
SMALLER = dict(n_layers=2, n_heads=2)        # for tests that train or save many times


def tiny_model(dtype="float64", **overrides) -> ModelConfig:
    return ModelConfig(dtype=dtype, **{**TINY, **overrides}).validate()


def tiny_train(**overrides) -> TrainConfig:
    base = dict(micro_batch_size=2, global_batch_size=8, max_iters=10, lr=1e-2, min_lr=1e-3,
                warmup_iters=2, weight_decay=0.1, grad_clip=1.0, seed=7)
    return TrainConfig(**{**base, **overrides}).validate()


def tiny_tokens(n=6000, vocab=65, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16)


def make_trainer(model_cfg=None, train_cfg=None, topo=None, tensor=1, pipeline=1, data=None, context=1,
                 expert=1, data_shard=None, **parallel) -> Trainer:
    """A Trainer on `topo`, or on a mesh of the world's ranks (data_shard: HSDP's S);
    `parallel` holds ParallelConfig fields (schedule, zero_stage, ...). Checked like
    the CLI checks."""
    model_cfg, train_cfg = model_cfg or tiny_model(), train_cfg or tiny_train()
    parallel_cfg = ParallelConfig(**parallel).validate()
    topo = topo or Topology.from_world(tensor, pipeline, data, context=context, expert=expert,
                                       ulysses=parallel_cfg.ulysses_group(context), data_shard=data_shard)
    check_layout(model_cfg, train_cfg, topo.mesh, parallel_cfg)
    return build_trainer(model_cfg, parallel_cfg, train_cfg, topo)


def train_steps(trainer, steps: int, tokens=None) -> list[float]:
    """The losses of `steps` training iterations."""
    tokens = tiny_tokens() if tokens is None else tokens
    return [trainer.train_step(tokens)["train_loss"] for _ in range(steps)]


def run(trainer, steps=10, tokens=None):
    """Train `steps` iterations; returns (losses, grad norms, full params on rank 0
    else None, trainer)."""
    tokens = tiny_tokens() if tokens is None else tokens
    steps_out = [trainer.train_step(tokens) for _ in range(steps)]
    losses, norms = [s["train_loss"] for s in steps_out], [s["grad_norm"] for s in steps_out]
    full = gather_stores(trainer.model, trainer.topo,
                         [{"params": optimizer.state.whole("params")} for optimizer in trainer.optimizers])
    return np.array(losses), np.array(norms), (full or {}).get("params"), trainer


def whole_buffers(optimizer) -> dict:
    """{params, adam_m, adam_v: the whole stage's flat buffer} on every rank (collective)."""
    return {buffer: optimizer.state.whole(buffer) for buffer in FLAT_BUFFERS}


def serial_reference(model_cfg, train_cfg, steps=10, tokens=None):
    return run(make_trainer(model_cfg, train_cfg, Topology.serial()), steps, tokens)


class MeshRun(NamedTuple):
    losses: np.ndarray
    reference_losses: np.ndarray
    params: dict | None        # full parameters on rank 0, None elsewhere
    trainer: Trainer


def check_mesh(mesh: dict, dtype="float64", rtol=EQUIV_RTOL_FLOAT64, model: dict | None = None,
               **train_overrides) -> MeshRun:
    """Ten iterations on `mesh` (tensor/pipeline/data/context/expert sizes, ParallelConfig
    fields, and n_layers if not 4) against one process: losses, gradient norms and every
    parameter (experts by their global name) within rtol on every rank. `model`:
    ModelConfig fields beside the tiny ones."""
    mesh, model = dict(mesh), dict(model or {})
    if "n_layers" in mesh:
        model["n_layers"] = mesh.pop("n_layers")
    model_cfg, train_cfg = tiny_model(dtype, **model), tiny_train(**train_overrides)
    losses, norms, params, trainer = run(make_trainer(model_cfg, train_cfg, **mesh))
    ref_losses, ref_norms, ref_params, _ = serial_reference(model_cfg, train_cfg)
    param_diff = None
    if trainer.topo.rank == 0:
        assert params.keys() == ref_params.keys()
        param_diff = max(rel_diff(*comparable(k, params[k], ref_params[k], dtype)) for k in ref_params)
    assert_close_on_every_rank({"loss": rel_diff(losses, ref_losses), "grad_norm": rel_diff(norms, ref_norms),
                                "params": MPI.COMM_WORLD.bcast(param_diff, root=0)}, rtol)
    return MeshRun(losses, ref_losses, params, trainer)


def comparable(name, actual, expected, dtype):
    """The key bias has an exactly zero gradient (softmax ignores a shift shared by a
    row of scores, and q . b_k is one), so in float32 its gradient is pure rounding
    noise, which Adam normalises into +-lr steps in any layout, serial included.
    Only there, and only in float32, it is left out of the comparison."""
    if dtype == "float32" and name.endswith("attn.qkv.bias"):
        return actual[[0, 2]], expected[[0, 2]]
    return actual, expected


def mesh_id(mesh):
    short = {"data_shard": "S", "bucket_size": "bucket", "overlap_grad_reduce": "overlap", "zero_stage": "zero", "virtual_stages": "v"}
    return "-".join(f"{short.get(k, k)}{v}" for k, v in mesh.items())


def assert_on_every_rank(checks: dict) -> None:
    """checks: {name: bool, or (measured, expected) that must be equal}. Every rank
    learns every rank's failures before asserting, so all ranks fail together instead
    of one failing while the others wait in the next collective."""
    def bad(value):
        return not value if isinstance(value, (bool, np.bool_)) else value[0] != value[1]
    failures = {f"rank {r}: {name}": value for r, c in enumerate(MPI.COMM_WORLD.allgather(checks))
                for name, value in c.items() if bad(value)}
    assert not failures, failures


def assert_close_on_every_rank(diffs: dict, rtol: float) -> None:
    """diffs: {name: relative difference}; the worst over all ranks must be <= rtol."""
    everyone = MPI.COMM_WORLD.allgather(diffs)
    worst = {k: max(d.get(k, 0.0) for d in everyone) for k in set().union(*everyone)}
    assert max(worst.values(), default=0.0) <= rtol, worst


def gathered(comm, value) -> list:
    """`value` from every rank of a group, in its order; a group of this rank alone has
    no MPI communicator (distributed/topology.py), so the list is [value]."""
    return [value] if comm.mpi is None else comm.mpi.allgather(value)


def identical_over(comm, array) -> bool:
    copies = gathered(comm, array)
    return all(np.array_equal(c, copies[0]) for c in copies)


# The training script as a user runs it (tests/test_cli.py, test_faults.py, ...).

PYTHON = sys.executable
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
TINY_FLAGS = ["--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--seq-len", "16", "--micro-batch-size", "4",
              "--dtype", "float64", "--eval-iters", "2", "--eval-interval", "5", "--log-interval", "1",
              "--warmup-iters", "3", "--no-progress"]


def run_script(args, nprocs=None, timeout=120, script="train_shakespeare.py", env=None):
    cmd = ([MPIEXEC, "-n", str(nprocs)] if nprocs else []) + [PYTHON, str(REPO / script)] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def train_script(data_dir, out_dir, *extra, nprocs=None):
    """train_shakespeare.py on the tiny model, from data_dir into out_dir."""
    return run_script(TINY_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), *extra], nprocs=nprocs)


def logged_losses(out_dir):
    """{iteration: training loss} from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["iter"]: r["train_loss"] for r in rows}


def assert_valid_trace(trace: dict) -> None:
    """A Chrome trace (numpitron/trace/): every event has a name, a phase, a time, a
    process and a thread, every complete event a duration, and the complete events of
    one track nest or follow each other, never overlapping partially."""
    tracks = {}
    for e in trace["traceEvents"]:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys(), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in tracks.values():              # each span inside the one open, or after it
        open_ends = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1e-3, f"partial overlap: {e}"
            open_ends.append(e["ts"] + e["dur"])


def error_lines(stderr):
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def snapshot(root: Path) -> dict:
    """Every file under root with the hash of its bytes (but the run directory's lock
    file, which each job that opens the directory stamps with its pid)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def rewrite_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


# One process saving every iteration: the checkpoint tests' model, batches and tokens.
CHECKPOINT_MODEL = tiny_model(**SMALLER)
CHECKPOINT_TRAIN = TrainConfig(micro_batch_size=2, global_batch_size=4, max_iters=10, warmup_iters=2, seed=1,
                               eval_iters=1, eval_interval=1)
CHECKPOINT_TOKENS = np.random.default_rng(0).integers(0, 65, 5000).astype(np.uint16)


def checkpoint_trainer(model_cfg=CHECKPOINT_MODEL) -> Trainer:
    return make_trainer(model_cfg, CHECKPOINT_TRAIN, Topology.serial())
