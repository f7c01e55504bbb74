"""Checkpoints on one process: exact round trip, format, atomicity, every refusal, .npz."""

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from numpitron.checkpoint import (export_npz, import_npz, latest_checkpoint, load_checkpoint,
                                  load_model_weights, read_manifest, save_checkpoint)
from numpitron.distributed.topology import Topology
from numpitron.errors import UserError
from numpitron.build import build_stage
from numpitron.checkpoint.prune import OWNER_MARKER
from tests.harness import CHECKPOINT_MODEL as MODEL, CHECKPOINT_TOKENS as TOKENS
from tests.harness import checkpoint_trainer as make_trainer, rewrite_manifest, train_steps
REPO = Path(__file__).resolve().parents[1]
SHARD = "shards/rank-00000.bin"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint after 3 steps, and the trainer that wrote it. Tests that damage
    a checkpoint work on a copy (see `copy_of`)."""
    trainer = make_trainer()
    train_steps(trainer, 3, TOKENS)
    trainer.best_val_loss = 3.25
    path = save_checkpoint(tmp_path_factory.mktemp("saved"), trainer)
    return path, trainer


@pytest.fixture
def copy_of(saved, tmp_path):
    path = tmp_path / "ckpt" / saved[0].name
    shutil.copytree(saved[0], path)
    return path


def expect_load_error(path: Path, *fragments: str) -> str:
    with pytest.raises(UserError) as caught:
        load_checkpoint(path, make_trainer())
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_round_trip_is_exact_and_training_continues_identically(tmp_path):
    trainer = make_trainer()
    train_steps(trainer, 3, TOKENS)
    trainer.best_val_loss = 3.25
    path = save_checkpoint(tmp_path, trainer)
    fresh = make_trainer()
    manifest = load_checkpoint(path, fresh)
    assert manifest["iteration"] == 3
    assert np.array_equal(fresh.model.store.data, trainer.model.store.data)
    assert np.array_equal(fresh.optimizer.adam.m, trainer.optimizer.adam.m)
    assert np.array_equal(fresh.optimizer.adam.v, trainer.optimizer.adam.v)
    assert fresh.optimizer.adam.step_count == trainer.optimizer.adam.step_count == 3
    assert fresh.iteration == 3 and fresh.best_val_loss == 3.25
    assert train_steps(fresh, 2, TOKENS) == train_steps(trainer, 2, TOKENS)


def test_round_trip_continues_like_an_uninterrupted_run(tmp_path):
    straight = make_trainer()
    expected = train_steps(straight, 5, TOKENS)
    first = make_trainer()
    train_steps(first, 3, TOKENS)
    resumed = make_trainer()
    load_checkpoint(save_checkpoint(tmp_path, first), resumed)
    assert train_steps(resumed, 2, TOKENS) == expected[3:]
    assert resumed.best_val_loss == float("inf")     # never evaluated: null in JSON, inf again


def test_manifest_and_tensors_have_full_logical_shapes(saved):
    path, trainer = saved
    manifest = read_manifest(path)
    assert manifest["format_version"] == 2 and manifest["adam_step"] == 3 and manifest["best_val_loss"] == 3.25
    assert manifest["data_state"] == {"sampler": "seeded-per-iteration", "seed": 1, "next_iteration": 3}
    assert manifest["mesh"] == {"tensor": 1, "pipeline": 1, "data": 1, "context": 1} and manifest["parallel_config"]["zero_stage"] == 0
    names = [p.name for p in trainer.model.parameters()]
    assert set(manifest["tensors"]) == set(names)
    assert manifest["tensors"]["embedding.token.weight"] == {"shape": [65, 32], "full_shape": [65, 32],
                                                             "split_axis": 0, "dtype": "float64"}
    # One process writes one file, and its pieces are every tensor's every element, back to back.
    assert list(manifest["files"]) == ["shards/rank-00000.bin"]
    size = sum(np.prod(trainer.model.store.by_name[n].logical_shape) for n in names) * 3 * 8
    assert manifest["files"]["shards/rank-00000.bin"]["bytes"] == size == (path / "shards/rank-00000.bin").stat().st_size
    assert {(p["kind"], p["name"]) for p in manifest["pieces"]} == {(k, n) for k in ("params", "adam_m", "adam_v") for n in names}
    assert (path.parent / "latest").read_text().strip() == path.name


def test_a_format1_checkpoint_is_refused_with_the_way_to_convert_it(copy_of):
    rewrite_manifest(copy_of, lambda m: m.update(format_version=1))
    expect_load_error(copy_of, "format 1", "no longer reads", "docs/16-checkpoints-and-sampling.md")


def test_latest_ignores_crash_leftovers_and_the_next_save_removes_only_its_own(tmp_path):
    trainer = make_trainer()
    first = save_checkpoint(tmp_path, trainer)
    crashed = tmp_path / ".tmp-iter_000009-123"                 # a crash mid-write: marked as ours
    crashed.mkdir()
    (crashed / OWNER_MARKER).touch()
    (tmp_path / ".trash-iter_000004-77" / "params").mkdir(parents=True)     # a crash mid-prune
    (tmp_path / "iter_000008" / "params").mkdir(parents=True)   # no manifest: incomplete
    (tmp_path / "latest").write_text("iter_000008\n")          # pointing at it
    users = [tmp_path / "iter_999999" / "notes.txt", tmp_path / ".tmp-notes", tmp_path / ".tmp-iter_000005-1" / "x"]
    for path in users:                                           # the user's own files
        path.parent.mkdir(exist_ok=True)
        path.write_text("mine")
    assert latest_checkpoint(tmp_path) == first
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == first
    assert latest_checkpoint(tmp_path / "nowhere") is None
    train_steps(trainer, 1, TOKENS)
    second = save_checkpoint(tmp_path, trainer)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-iter_000005-1", ".tmp-notes", "iter_000000",
                                                          "iter_000001", "iter_000008", "iter_999999", "latest"]
    assert all(path.read_text() == "mine" for path in users)
    assert latest_checkpoint(tmp_path) == second


def test_pruning_spares_a_checkpoint_holding_a_file_it_did_not_write(tmp_path):
    trainer = make_trainer()
    kept = save_checkpoint(tmp_path, trainer, keep=1)
    (kept / "README.txt").write_text("my notes on this run")
    train_steps(trainer, 1, TOKENS)
    save_checkpoint(tmp_path, trainer, keep=1)
    assert (kept / "README.txt").read_text() == "my notes on this run" and (kept / "manifest.json").is_file()


def test_keep_prunes_to_the_newest_but_spares_protect(tmp_path):
    trainer = make_trainer()
    best = save_checkpoint(tmp_path, trainer, keep=2)           # iter 0: the "best" one
    for _ in range(3):
        train_steps(trainer, 1, TOKENS)
        last = save_checkpoint(tmp_path, trainer, keep=2, protect=best)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_000000", "iter_000002", "iter_000003"]
    save_checkpoint(tmp_path, trainer, keep=1)                   # re-save of iteration 3, no protect
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_000003"]
    assert latest_checkpoint(tmp_path) == last
    load_checkpoint(last, make_trainer())                        # the replaced copy is whole


def test_save_failure_is_a_user_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="cannot write checkpoint to"):
        save_checkpoint(blocker, make_trainer())


def test_model_config_mismatch_names_every_field(saved):
    other = replace(MODEL, n_layers=4, d_model=64)
    with pytest.raises(UserError) as caught:
        load_checkpoint(saved[0], make_trainer(other))
    assert str(caught.value) == "checkpoint model config differs from the flags: n_layers 2 != 4, d_model 32 != 64"
    with pytest.raises(UserError, match="n_heads 2 != 4"):
        load_model_weights(saved[0], build_stage(replace(MODEL, n_heads=4), Topology.serial()),
                           replace(MODEL, n_heads=4))


def test_truncated_shard_is_refused(copy_of):
    (copy_of / SHARD).write_bytes((copy_of / SHARD).read_bytes()[:-100])
    expect_load_error(copy_of, SHARD, "bytes", "truncated")


def test_flipped_byte_fails_the_checksum(copy_of):
    data = bytearray((copy_of / SHARD).read_bytes())
    data[-3] ^= 0x01
    (copy_of / SHARD).write_bytes(bytes(data))
    expect_load_error(copy_of, SHARD, "fails its crc32 checksum")


def test_newer_format_version_is_refused(copy_of):
    rewrite_manifest(copy_of, lambda m: m.update(format_version=3))
    message = expect_load_error(copy_of)
    assert message == "checkpoint format version 3 is newer than this numpitron supports (2); upgrade numpitron"


def test_an_archive_holding_an_object_array_is_refused_before_loading(saved, tmp_path):
    archive = export_npz(saved[0], tmp_path / "w.npz")
    with np.load(archive) as npz:
        arrays = dict(npz)
    arrays["ln_f.bias"] = np.array([{"evil": 1}] * 32, dtype=object)
    np.savez(tmp_path / "evil.npz", allow_pickle=True, **arrays)
    with pytest.raises(UserError, match="would need pickle; refusing to load"):
        import_npz(tmp_path / "evil.npz", tmp_path / "root")
    assert not (tmp_path / "root").exists()


def duplicate_half(manifest):
    """The first half of a piece listed twice, its second half never: the element count
    still adds up, but half the tensor would be garbage."""
    piece = manifest["pieces"][5]
    middle = (piece["start"] + piece["stop"]) // 2
    manifest["pieces"].append({**piece, "stop": middle})
    piece["stop"] = middle


@pytest.mark.parametrize("edit, fragment", [
    (lambda m: m["pieces"][3].pop("offset"), "a piece lacks one of"),
    (lambda m: m["tensors"]["ln_f.weight"].update(dtype="object"), "only floats are stored"),
    (lambda m: m["pieces"][2].update(stop=10**9), "lies outside its tensor or its file"),
    (lambda m: m["files"].update({"../../etc/passwd": {"bytes": 1}}), "is not a shard of this checkpoint"),
    (duplicate_half, "cover the same elements"),
], ids=["missing-field", "object-dtype", "out-of-range", "escaping-path", "duplicate-coverage"])
def test_a_malformed_manifest_is_one_line(copy_of, edit, fragment):
    rewrite_manifest(copy_of, edit)
    expect_load_error(copy_of, "corrupt checkpoint manifest", fragment)


def test_pieces_that_leave_a_hole_are_refused(copy_of):
    rewrite_manifest(copy_of, lambda m: m["pieces"][5].update(stop=m["pieces"][5]["stop"] - 1))
    expect_load_error(copy_of, "cover", "elements")


def test_missing_or_broken_manifest_is_refused(copy_of, tmp_path):
    (copy_of / "manifest.json").write_text("{not json")
    expect_load_error(copy_of, "unreadable checkpoint manifest")
    (copy_of / "manifest.json").unlink()
    expect_load_error(copy_of, "manifest.json is missing")
    expect_load_error(tmp_path / "no-such-dir", "checkpoint not found")


def test_missing_shard_is_refused(copy_of):
    (copy_of / SHARD).unlink()
    expect_load_error(copy_of, f"{SHARD} is missing (one rank's shard)")


def test_load_model_weights_restores_parameters_only(saved):
    path, trainer = saved
    model = build_stage(MODEL, Topology.serial(), seed=99)
    manifest = load_model_weights(path, model, MODEL)
    assert manifest["iteration"] == 3
    assert np.array_equal(model.store.data, trainer.model.store.data)


def test_npz_export_import_round_trip(saved, tmp_path):
    path, trainer = saved
    archive = export_npz(path, tmp_path / "weights.npz")
    with np.load(archive, allow_pickle=False) as npz:
        assert json.loads(str(npz["__model_config__"][()]))["d_model"] == 32
        assert npz["embedding.token.weight"].shape == (65, 32)
    imported = import_npz(archive, tmp_path / "root")
    assert imported == tmp_path / "root" / "iter_000000" == latest_checkpoint(tmp_path / "root")
    fresh = make_trainer()
    fresh.optimizer.adam.m += 1.0                  # must be reset by the import's zero moments
    manifest = load_checkpoint(imported, fresh)
    assert manifest["iteration"] == 0 and manifest["adam_step"] == 0
    assert np.array_equal(fresh.model.store.data, trainer.model.store.data)
    assert not fresh.optimizer.adam.m.any() and fresh.optimizer.adam.step_count == 0


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numpitron.checkpoint.convert", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def test_convert_cli_prints_one_line_and_reports_errors(saved, tmp_path):
    done = run_cli("export", saved[0], tmp_path / "w.npz")
    assert done.returncode == 0 and done.stderr == "" and len(done.stdout.splitlines()) == 1, done
    done = run_cli("import", tmp_path / "w.npz", tmp_path / "root")
    assert done.returncode == 0 and done.stderr == "" and len(done.stdout.splitlines()) == 1, done
    assert (tmp_path / "root" / "iter_000000" / "manifest.json").is_file()
    failed = run_cli("export", tmp_path / "no-such-checkpoint", tmp_path / "x.npz")
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.startswith("error: checkpoint not found") and len(failed.stderr.splitlines()) == 1
