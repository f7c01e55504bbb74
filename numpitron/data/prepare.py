"""Turn Tiny Shakespeare into tokenizer.json, train.bin and val.bin.

Run as `python -m numpitron.data.prepare [--data-dir DIR] [--input PATH]`.
"""

import argparse
import hashlib
import http.client
import os
import secrets
import sys
import urllib.request
from pathlib import Path


from numpitron.data.prepared import RECORD_NAME, write_record
from numpitron.data.tokenizer import CharTokenizer
from numpitron.errors import UserError

SOURCE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TEXT_NAME = "tinyshakespeare.txt"
TOKENIZER_NAME = "tokenizer.json"
TRAIN_NAME = "train.bin"
VAL_NAME = "val.bin"
TRAIN_FRACTION = 0.9
DOWNLOAD_TIMEOUT_SECONDS = 20


def prepared_paths(data_dir) -> dict:
    """Where prepare_data puts (or put) each of its outputs."""
    data_dir = Path(data_dir)
    return {
        "text": data_dir / TEXT_NAME,
        "tokenizer": data_dir / TOKENIZER_NAME,
        "train": data_dir / TRAIN_NAME,
        "val": data_dir / VAL_NAME,
    }


def is_prepared(data_dir) -> bool:
    paths = prepared_paths(data_dir)
    return all(paths[key].is_file() for key in ("tokenizer", "train", "val"))


def ensure_prepared(data_dir, input_path=None, quiet=False) -> dict:
    """Prepare only when some output is missing, so repeated runs cost nothing."""
    if is_prepared(data_dir):
        return prepared_paths(data_dir)
    return prepare_data(data_dir, input_path=input_path, quiet=quiet)


def prepare_data(data_dir, input_path=None, quiet=False, expected_sha256=SHA256) -> dict:
    """Find (or download) the text, check it, and write the tokenizer and token files.

    expected_sha256=None skips the hash check so tests can use a small synthetic text.
    """
    paths = prepared_paths(data_dir)
    data_dir = Path(data_dir)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create data directory {data_dir}: {exc.strerror or exc}") from None

    raw = _obtain_text_bytes(data_dir, paths["text"], input_path, expected_sha256, quiet)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{paths['text']} is not UTF-8 text") from None
    if len(text) < 2:
        raise UserError(f"{paths['text']} is too short to split into train and val")

    tokenizer = CharTokenizer.from_text(text)
    ids = tokenizer.encode(text)
    n_train = int(len(ids) * TRAIN_FRACTION)
    _write_atomically(paths["train"], ids[:n_train].tobytes())
    _write_atomically(paths["val"], ids[n_train:].tobytes())
    _replace_atomically(paths["tokenizer"], tokenizer.save)
    # Last: the record of what was written, which training checks before using it.
    written = [paths[k] for k in ("tokenizer", "train", "val")]
    _replace_atomically(data_dir / RECORD_NAME, lambda tmp: write_record(tmp, written, tokenizer.vocab_size))
    _say(quiet, f"vocab {tokenizer.vocab_size}, train {n_train:,} tokens, "
                f"val {len(ids) - n_train:,} tokens -> {data_dir}")
    return paths


def _obtain_text_bytes(data_dir, text_path, input_path, expected_sha256, quiet) -> bytes:
    """Return the verified corpus bytes, leaving a copy at text_path."""
    if input_path is not None:
        source = Path(input_path)
        if not source.is_file():
            raise UserError(f"input file not found: {source}")
        raw = _read_bytes(source)
        _check_sha256(raw, expected_sha256, str(source))
        if not (text_path.exists() and source.resolve() == text_path.resolve()):
            _write_atomically(text_path, raw)
        return raw
    if text_path.is_file():
        raw = _read_bytes(text_path)
        _check_sha256(raw, expected_sha256, str(text_path))
        return raw
    _say(quiet, f"downloading {SOURCE_URL}")
    raw = _download(data_dir)
    # Verify before saving so a bad download never sits in data_dir looking valid.
    _check_sha256(raw, expected_sha256, SOURCE_URL)
    _write_atomically(text_path, raw)
    return raw


def _download(data_dir) -> bytes:
    try:
        with urllib.request.urlopen(SOURCE_URL, timeout=DOWNLOAD_TIMEOUT_SECONDS) as response:
            return response.read()
    except (OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise UserError(
            f"cannot download Tiny Shakespeare ({reason}); "
            f"put {TEXT_NAME} in {data_dir} or pass --input PATH"
        ) from None


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def _check_sha256(raw: bytes, expected_sha256, origin: str) -> None:
    if expected_sha256 is None:
        return
    actual = hashlib.sha256(raw).hexdigest()
    if actual != expected_sha256:
        raise UserError(f"{origin} has sha256 {actual}, expected {expected_sha256}")


def _write_atomically(path: Path, payload: bytes) -> None:
    _replace_atomically(path, lambda tmp_path: tmp_path.write_bytes(payload))


def _replace_atomically(path: Path, write) -> None:
    """Let write(tmp_path) fill a temp file beside path, then rename it over path.

    The rename is atomic within one directory, so a crash leaves either the old
    file or the complete new one, never half a file.
    """
    # A name unique to this process, created by write() itself so the file gets
    # the usual umask-based permissions (mkstemp would force 0600).
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp_path)
        os.replace(tmp_path, path)
    except OSError as exc:
        _remove_quietly(tmp_path)
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        _remove_quietly(tmp_path)
        raise


def _remove_quietly(name: Path) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m numpitron.data.prepare",
        description="Prepare Tiny Shakespeare: tokenizer.json, train.bin, val.bin.",
    )
    parser.add_argument("--data-dir", default="data", help="output directory (default: data)")
    parser.add_argument("--input", default=None, help="use this local copy instead of downloading")
    args = parser.parse_args(argv)
    try:
        prepare_data(args.data_dir, input_path=args.input)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    return 0


if __name__ == "__main__":
    main()
