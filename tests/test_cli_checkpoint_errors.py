"""Every way a checkpoint can be unusable, as a user meets it: `--resume` or
`sample.py` exits non-zero with one line that says what is wrong, and the
checkpoint on disk is left as it was."""

import json
import shutil

import pytest

from tests.harness import TINY_FLAGS, run_script, train_script


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("trained")
    assert train_script(data_dir, out, "--max-iters", "2").returncode == 0
    return out


@pytest.fixture
def victim(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out, next((out / "checkpoints").glob("iter_*"))


def edit_manifest(ckpt, edit):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    edit(manifest)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


SHARD = "shards/rank-00000.bin"


def truncate(ckpt):
    target = ckpt / SHARD
    target.write_bytes(target.read_bytes()[:-16])


def flip_a_byte(ckpt):
    target = ckpt / SHARD
    raw = bytearray(target.read_bytes())
    raw[-5] ^= 0x10
    target.write_bytes(bytes(raw))


def lose_a_shard(ckpt):
    (ckpt / SHARD).unlink()


def newer_format(ckpt):
    edit_manifest(ckpt, lambda m: m.update(format_version=m["format_version"] + 1))


DAMAGE = {
    "truncated": (truncate, "(truncated or overwritten?)"),
    "checksum": (flip_a_byte, "fails its crc32 checksum"),
    "newer-format": (newer_format, "is newer than this numpitron supports"),
    "missing-shard": (lose_a_shard, "is missing (one rank's shard)"),
}


def assert_one_line_error(result, fragment):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_checkpoint_fails_resume_and_sampling_with_one_line(data_dir, victim, damage):
    out, ckpt = victim
    harm, fragment = DAMAGE[damage]
    harm(ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    resumed = train_script(data_dir, out, "--max-iters", "4", "--resume")
    assert_one_line_error(resumed, fragment)
    sampled = run_script(["--out-dir", str(out), "--max-new-tokens", "5"], script="sample.py")
    assert_one_line_error(sampled, fragment)
    assert {p.name: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def test_model_flags_that_disagree_with_the_checkpoint(data_dir, victim):
    out, _ = victim
    flags = [a if a != "32" else "64" for a in TINY_FLAGS]          # --d-model 64 instead of 32
    result = run_script(flags + ["--data-dir", str(data_dir), "--out-dir", str(out), "--max-iters", "4", "--resume"])
    assert_one_line_error(result, "checkpoint model config differs from the flags: d_model 32 != 64")
