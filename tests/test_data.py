"""Tests for numpitron.data: tokenizer, preparation of Tiny Shakespeare, batches."""

import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from numpitron.data import prepare
from numpitron.data.batches import batch_rng, global_batch, load_tokens, sample_windows
from numpitron.data.tokenizer import CharTokenizer
from numpitron.errors import UserError
from tests.conftest import shakespeare_text_path

@pytest.fixture(scope="module")
def shakespeare_path() -> Path:
    return shakespeare_text_path()


@pytest.fixture(scope="module")
def shakespeare_text(shakespeare_path) -> str:
    return shakespeare_path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def prepared_shakespeare(tmp_path_factory, shakespeare_path) -> dict:
    data_dir = tmp_path_factory.mktemp("prepared")
    return prepare.prepare_data(data_dir, input_path=shakespeare_path, quiet=True)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


# --- tokenizer ---------------------------------------------------------------


def test_tokenizer_round_trips_shakespeare(shakespeare_text):
    tokenizer = CharTokenizer.from_text(shakespeare_text)
    assert tokenizer.vocab_size == 65
    ids = tokenizer.encode(shakespeare_text)
    assert ids.dtype == np.uint16
    assert tokenizer.decode(ids) == shakespeare_text
    assert tokenizer.decode(ids[:10].tolist()) == shakespeare_text[:10]


def test_unknown_characters_are_named_once_in_order():
    tokenizer = CharTokenizer.from_text("abc ")
    with pytest.raises(UserError) as info:
        tokenizer.encode("a é b € é")
    message = str(info.value)
    assert message == "prompt has characters outside the vocabulary: 'é', '€'"
    assert "\n" not in message


def test_tokenizer_save_load_round_trip(tmp_path):
    tokenizer = CharTokenizer.from_text("hello, world\n")
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    loaded = CharTokenizer.load(path)
    assert loaded.chars == tokenizer.chars
    assert loaded.decode(loaded.encode("hello")) == "hello"


def test_tokenizer_load_missing_or_corrupt_names_path(tmp_path):
    missing = tmp_path / "absent.json"
    with pytest.raises(UserError, match="absent.json"):
        CharTokenizer.load(missing)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    with pytest.raises(UserError, match="corrupt.json"):
        CharTokenizer.load(corrupt)
    wrong_kind = tmp_path / "wrong.json"
    wrong_kind.write_text('{"kind": "bpe", "chars": ["a"]}')
    with pytest.raises(UserError, match="wrong.json"):
        CharTokenizer.load(wrong_kind)


# --- prepare -----------------------------------------------------------------


def test_prepare_splits_shakespeare_90_10(prepared_shakespeare, shakespeare_text):
    paths = prepared_shakespeare
    train = np.fromfile(paths["train"], dtype=np.uint16)
    val = np.fromfile(paths["val"], dtype=np.uint16)
    assert len(train) + len(val) == len(shakespeare_text)
    assert len(train) == int(len(shakespeare_text) * 0.9)
    tokenizer = CharTokenizer.load(paths["tokenizer"])
    assert tokenizer.vocab_size == 65
    assert tokenizer.decode(train) == shakespeare_text[: len(train)]
    assert tokenizer.decode(val) == shakespeare_text[len(train):]
    assert paths["text"].read_text(encoding="utf-8") == shakespeare_text
    assert prepare.is_prepared(paths["train"].parent)
    assert not [p for p in paths["train"].parent.iterdir() if p.name.endswith(".tmp")]


def test_prepare_rejects_wrong_hash(tmp_path):
    text_file = tmp_path / "other.txt"
    text_file.write_text("not shakespeare\n")
    with pytest.raises(UserError, match="sha256") as info:
        prepare.prepare_data(tmp_path / "data", input_path=text_file, quiet=True)
    assert prepare.SHA256 in str(info.value)


def test_prepare_missing_explicit_input(tmp_path):
    with pytest.raises(UserError, match="nowhere.txt"):
        prepare.prepare_data(tmp_path / "data", input_path=tmp_path / "nowhere.txt", quiet=True)


def test_prepare_offline_without_file_names_data_dir(tmp_path, no_network):
    data_dir = tmp_path / "offline_data"
    with pytest.raises(UserError) as info:
        prepare.prepare_data(data_dir, quiet=True)
    message = str(info.value)
    assert str(data_dir) in message
    assert "--input" in message
    assert "network disabled" in message


def test_prepare_skipping_hash_accepts_synthetic_text(tmp_path):
    text = "to be or not to be\n" * 20
    source = tmp_path / "small.txt"
    source.write_text(text)
    paths = prepare.prepare_data(tmp_path / "data", input_path=source, quiet=True, expected_sha256=None)
    train = np.fromfile(paths["train"], dtype=np.uint16)
    val = np.fromfile(paths["val"], dtype=np.uint16)
    assert len(train) == int(len(text) * 0.9) and len(train) + len(val) == len(text)


def test_ensure_prepared_leaves_existing_files_alone(tmp_path, no_network):
    source = tmp_path / "small.txt"
    source.write_text("some small text for preparing\n" * 10)
    data_dir = tmp_path / "data"
    paths = prepare.prepare_data(data_dir, input_path=source, quiet=True, expected_sha256=None)
    past = 1_000_000_000
    for key in ("tokenizer", "train", "val"):
        os.utime(paths[key], (past, past))
    again = prepare.ensure_prepared(data_dir, quiet=True)
    for key in ("tokenizer", "train", "val"):
        assert again[key] == paths[key]
        assert paths[key].stat().st_mtime == past


def test_main_reports_user_error_on_one_line(tmp_path, capsys, no_network):
    with pytest.raises(SystemExit) as info:
        prepare.main(["--data-dir", str(tmp_path / "empty")])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot download Tiny Shakespeare")
    assert err.count("\n") == 1


# --- batches -----------------------------------------------------------------


def test_sample_windows_shapes_and_shift(prepared_shakespeare):
    tokens = load_tokens(prepared_shakespeare["train"])
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    rng = np.random.default_rng(0)
    x, y = sample_windows(tokens, batch_size=8, seq_len=32, rng=rng)
    assert x.shape == y.shape == (8, 32)
    assert x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    # Each row must be a real window of the file, with y one token ahead of x.
    all_tokens = np.asarray(tokens, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(all_tokens, 33)
    for row_x, row_y in zip(x, y):
        starts = np.flatnonzero((windows[:, :32] == row_x).all(axis=1))
        assert any((all_tokens[s + 1 : s + 33] == row_y).all() for s in starts)


def test_sample_windows_reaches_last_token_without_overrun():
    tokens = np.arange(5, dtype=np.uint16)
    x, y = sample_windows(tokens, batch_size=50, seq_len=4, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(x, np.tile(np.arange(4), (50, 1)))
    np.testing.assert_array_equal(y, np.tile(np.arange(1, 5), (50, 1)))


def test_sample_windows_too_short_raises():
    with pytest.raises(UserError, match="too short"):
        sample_windows(np.arange(4, dtype=np.uint16), 2, 4, np.random.default_rng(0))


def test_global_batch_is_deterministic(prepared_shakespeare):
    tokens = load_tokens(prepared_shakespeare["val"])
    x1, y1 = global_batch(tokens, seed=7, stream="train", index=3, batch_size=4, seq_len=16)
    x2, y2 = global_batch(tokens, seed=7, stream="train", index=3, batch_size=4, seq_len=16)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    x3, _ = global_batch(tokens, seed=7, stream="train", index=4, batch_size=4, seq_len=16)
    x4, _ = global_batch(tokens, seed=7, stream="val", index=3, batch_size=4, seq_len=16)
    assert not np.array_equal(x1, x3)
    assert not np.array_equal(x1, x4)
    assert batch_rng(7, "train", 3).integers(1 << 30) == batch_rng(7, "train", 3).integers(1 << 30)


def test_load_tokens_missing_or_corrupt(tmp_path):
    with pytest.raises(UserError, match="prepare"):
        load_tokens(tmp_path / "train.bin")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(UserError, match="corrupt"):
        load_tokens(odd)
