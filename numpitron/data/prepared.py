"""Loading prepared data only after checking it: what `prepare` wrote, and nothing else.

`prepare` records each file's size and CRC-32 and the vocabulary size in
prepared.json. Before training, every file is checked against that record, every
token id against the vocabulary, and each split's length against the context, so a
corrupt or hand-edited file stops the run with one line that names it, instead of
training on garbage. (Data prepared before the record existed is checked for ids and
lengths only.)
"""

import json
from pathlib import Path

import numpy as np

from numpitron.checksum import file_crc32
from numpitron.data.batches import load_tokens
from numpitron.data.tokenizer import CharTokenizer
from numpitron.errors import UserError

RECORD_NAME = "prepared.json"


def write_record(path: Path, files: list, vocab_size: int) -> None:
    """The record of the prepared `files`, written to `path` (by `prepare`, last)."""
    record = {"vocab_size": vocab_size,
              "files": {Path(f).name: {"bytes": Path(f).stat().st_size, "crc32": file_crc32(Path(f))} for f in files}}
    Path(path).write_text(json.dumps(record, indent=1) + "\n")


def _redo(data_dir: Path) -> str:
    return (f"delete {RECORD_NAME}, tokenizer.json, train.bin and val.bin in {data_dir} and run "
            f"`python -m numpitron.data.prepare --data-dir {data_dir}` (training also prepares missing files)")


def load_prepared(paths: dict, seq_len: int):
    """(tokenizer, {"train": tokens, "val": tokens}) after every check."""
    data_dir = paths["tokenizer"].parent
    record_path = data_dir / RECORD_NAME
    record = None
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            files = record["files"]
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"unreadable {record_path}; {_redo(data_dir)}") from None
        for role in ("tokenizer", "train", "val"):
            path, entry = paths[role], files.get(paths[role].name)
            if entry is None or not path.is_file():
                raise UserError(f"{path} is missing or not in {RECORD_NAME}; {_redo(data_dir)}")
            if path.stat().st_size != entry.get("bytes") or file_crc32(path) != entry.get("crc32"):
                raise UserError(f"{path} has changed since it was prepared (size or checksum); {_redo(data_dir)}")
    tokenizer = CharTokenizer.load(paths["tokenizer"])
    if record is not None and record.get("vocab_size") != tokenizer.vocab_size:
        raise UserError(f"{paths['tokenizer']} has {tokenizer.vocab_size} characters, {RECORD_NAME} says "
                        f"{record.get('vocab_size')}; {_redo(data_dir)}")
    splits = {}
    for role in ("train", "val"):
        tokens = load_tokens(paths[role])
        if len(tokens) < seq_len + 1:
            raise UserError(f"{paths[role]} has {len(tokens)} tokens, too few for --seq-len {seq_len} "
                            f"(needs {seq_len + 1})")
        top = int(np.max(tokens))
        if top >= tokenizer.vocab_size:
            raise UserError(f"{paths[role]} holds token id {top}, outside the vocabulary of "
                            f"{tokenizer.vocab_size} in {paths['tokenizer']}; {_redo(data_dir)}")
        splits[role] = tokens
    return tokenizer, splits
