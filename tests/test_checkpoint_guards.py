"""What a checkpoint must refuse, on one process: pieces that leave a tp shard empty,
shapes larger than the model, a directory or `latest` it did not write, an import
that would rewind a run, an export over something it must not replace. Each refusal
is one UserError line, and nothing on disk changes."""

import json
import os
import shutil

import numpy as np
import pytest

from numpitron.checkpoint import export_npz, import_npz, load_checkpoint, load_model_weights, save_checkpoint
from numpitron.checkpoint.convert import CONFIG_KEY
from numpitron.errors import UserError
from numpitron.build import build_stage
from tests.harness import CHECKPOINT_MODEL as MODEL, CHECKPOINT_TOKENS as TOKENS, checkpoint_trainer as make_trainer
from tests.harness import rewrite_manifest, snapshot
from tests.harness import train_steps


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    trainer = make_trainer()
    train_steps(trainer, 1, TOKENS)
    return save_checkpoint(tmp_path_factory.mktemp("saved"), trainer)


@pytest.fixture
def victim(saved, tmp_path):
    """A copy of the checkpoint inside its own root."""
    path = tmp_path / "root" / saved.name
    shutil.copytree(saved, path)
    (path.parent / "latest").write_text(saved.name + "\n")
    return path


def refused(call, *fragments):
    with pytest.raises(UserError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def as_if_tp2_without_rank1(manifest, name="blocks.0.mlp.proj.weight"):
    """Every piece of `name` relabelled as tp rank 0 of 2 holding its first half (rows
    0-63 of a (128, 32) weight split on axis 0): tp rank 1's pieces are gone."""
    for piece in manifest["pieces"]:
        if piece["name"] == name:
            piece.update(tp_size=2, stop=piece["stop"] // 2)


def test_a_tp_rank_without_pieces_is_refused_by_resume_sampling_and_export(victim, tmp_path):
    rewrite_manifest(victim, as_if_tp2_without_rank1)
    before = snapshot(victim.parent)
    fragment = "leave 2048 of its elements uncovered on tp rank 1 of 2"
    refused(lambda: load_checkpoint(victim, make_trainer()), "blocks.0.mlp.proj.weight", fragment)
    refused(lambda: load_model_weights(victim, build_stage(MODEL, make_trainer().topo), MODEL), fragment)
    refused(lambda: export_npz(victim, tmp_path / "w.npz"), fragment)
    assert snapshot(victim.parent) == before and not (tmp_path / "w.npz").exists()


def test_a_tensor_missing_from_the_manifest_is_refused_by_export(victim, tmp_path):
    def drop(manifest):
        del manifest["tensors"]["ln_f.bias"]
        manifest["pieces"] = [p for p in manifest["pieces"] if p["name"] != "ln_f.bias"]
    rewrite_manifest(victim, drop)
    refused(lambda: export_npz(victim, tmp_path / "w.npz"), "do not match its model config", "missing ln_f.bias")


def test_a_huge_claimed_shape_is_refused_before_anything_is_allocated(victim, tmp_path):
    rewrite_manifest(victim, lambda m: m["tensors"]["ln_f.weight"].update(shape=[10**12], full_shape=[10**12]))
    for call in (lambda: load_checkpoint(victim, make_trainer()), lambda: export_npz(victim, tmp_path / "w.npz")):
        refused(call, "ln_f.weight", "uncovered")


def test_a_shape_that_differs_from_the_model_is_refused_before_reading(victim):
    def shrink(manifest):
        manifest["tensors"]["ln_f.weight"].update(shape=[16], full_shape=[16])
        for piece in manifest["pieces"]:
            if piece["name"] == "ln_f.weight":
                piece["stop"] = 16
    rewrite_manifest(victim, shrink)
    refused(lambda: load_checkpoint(victim, make_trainer()), "does not fit this model: ln_f.weight has shape (16,)")


def test_a_save_never_replaces_a_directory_or_latest_it_did_not_write(tmp_path):
    trainer = make_trainer()
    first = save_checkpoint(tmp_path, trainer)
    train_steps(trainer, 1, TOKENS)
    theirs = tmp_path / "iter_000001"
    theirs.mkdir()
    (theirs / "my_notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    refused(lambda: save_checkpoint(tmp_path, trainer), "iter_000001", "did not write")
    assert snapshot(tmp_path) == before and (tmp_path / "latest").read_text() == first.name + "\n"
    shutil.rmtree(theirs)
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()                 # a user's directory where the pointer goes
    refused(lambda: save_checkpoint(tmp_path, trainer), "latest", "not a file numpitron wrote")
    assert (tmp_path / "latest").is_dir()


def test_a_resave_replaces_its_own_checkpoint_but_keeps_a_users_note(tmp_path):
    trainer = make_trainer()
    path = save_checkpoint(tmp_path, trainer)
    save_checkpoint(tmp_path, trainer)            # ours: replaced
    (path / "my_notes.txt").write_text("mine")
    refused(lambda: save_checkpoint(tmp_path, trainer), "did not write")
    assert (path / "my_notes.txt").read_text() == "mine"
    load_checkpoint(path, make_trainer())


def test_import_refuses_a_directory_that_holds_checkpoints(victim, tmp_path):
    archive = export_npz(victim, tmp_path / "w.npz")
    before = snapshot(victim.parent)
    refused(lambda: import_npz(archive, victim.parent), "already holds checkpoints")
    assert snapshot(victim.parent) == before
    user_root = tmp_path / "user"
    user_root.mkdir()
    (user_root / "latest").write_text("my own notes")
    refused(lambda: import_npz(archive, user_root), "already holds checkpoints")
    assert (user_root / "latest").read_text() == "my own notes"


def test_import_writes_a_format2_checkpoint_that_loads_exactly(victim, tmp_path):
    archive = export_npz(victim, tmp_path / "w.npz")
    imported = import_npz(archive, tmp_path / "fresh")
    manifest = json.loads((imported / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and list(manifest["files"]) == ["shards/rank-00000.bin"]
    model = build_stage(MODEL, make_trainer().topo, seed=5)
    load_model_weights(imported, model, MODEL)
    expected = build_stage(MODEL, make_trainer().topo, seed=6)
    load_model_weights(victim, expected, MODEL)
    assert np.array_equal(model.store.data, expected.store.data)


@pytest.mark.parametrize("change", [{"d_model": 100000}, {"n_layers": 10**9}])
def test_import_of_a_config_too_large_for_memory_is_one_line(victim, tmp_path, change):
    archive = export_npz(victim, tmp_path / "w.npz")
    with np.load(archive) as npz:
        arrays = dict(npz)
    arrays[CONFIG_KEY] = np.array(json.dumps({**json.loads(str(arrays[CONFIG_KEY][()])), **change}))
    np.savez(tmp_path / "big.npz", **arrays)
    refused(lambda: import_npz(tmp_path / "big.npz", tmp_path / "out"), "importing", "GiB per rank")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_import_refuses_weights_that_are_not_finite(victim, tmp_path, bad):
    archive = export_npz(victim, tmp_path / "w.npz")
    with np.load(archive) as npz:
        arrays = dict(npz)
    arrays["blocks.1.attn.proj.weight"][2, 3] = bad
    np.savez(tmp_path / "bad.npz", **arrays)
    refused(lambda: import_npz(tmp_path / "bad.npz", tmp_path / "out"), "blocks.1.attn.proj.weight holds NaN")
    assert not (tmp_path / "out").exists()


def test_export_replaces_a_file_only_when_told_and_never_anything_else(victim, tmp_path):
    target = tmp_path / "w.npz"
    target.write_text("a user's file")
    refused(lambda: export_npz(victim, target), "exists; pass --force")
    assert target.read_text() == "a user's file"
    export_npz(victim, target, overwrite=True)
    assert np.load(target)["ln_f.weight"].shape == (32,)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    refused(lambda: export_npz(victim, pipe, overwrite=True), "not a regular file")
    assert pipe.is_fifo()
    before = snapshot(victim.parent)
    refused(lambda: export_npz(victim, victim / "manifest.json", overwrite=True), "inside checkpoint")
    refused(lambda: export_npz(victim, victim.parent / "latest", overwrite=True), "pointer to the newest")
    assert snapshot(victim.parent) == before
