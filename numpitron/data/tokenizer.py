"""Character-level tokenizer: one token per distinct character of the corpus."""

import json
from pathlib import Path

import numpy as np

from numpitron.errors import UserError


class CharTokenizer:
    """Maps each character to its index in a sorted list of unique characters."""

    def __init__(self, chars: list[str]):
        # Sorting makes the id assignment independent of the order characters
        # were seen, so the same corpus always yields the same vocabulary.
        self.chars = sorted(set(chars))
        if any(len(c) != 1 for c in self.chars):
            raise UserError("tokenizer vocabulary must consist of single characters")
        if len(self.chars) > np.iinfo(np.uint16).max + 1:
            raise UserError(f"vocabulary of {len(self.chars)} characters does not fit in uint16")
        self._id_of = {c: i for i, c in enumerate(self.chars)}
        # A lookup array lets decode turn a whole id array into characters at once.
        self._char_array = np.array(self.chars, dtype="<U1")

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(list(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        unknown = [c for c in dict.fromkeys(text) if c not in self._id_of]
        if unknown:
            names = ", ".join(repr(c) for c in unknown)
            raise UserError(f"prompt has characters outside the vocabulary: {names}")
        id_of = self._id_of
        return np.fromiter((id_of[c] for c in text), dtype=np.uint16, count=len(text))

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise UserError(f"token ids must lie in [0, {self.vocab_size}) to decode")
        return "".join(self._char_array[ids].tolist())

    def to_dict(self) -> dict:
        return {"kind": "char", "chars": list(self.chars)}

    @classmethod
    def from_dict(cls, payload, origin: str = "checkpoint manifest") -> "CharTokenizer":
        if not _is_char_payload(payload):
            raise UserError(f"corrupt tokenizer in {origin}: expected a char tokenizer")
        return cls(payload["chars"])

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, path) -> "CharTokenizer":
        path = Path(path)
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"tokenizer file not found: {path}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read tokenizer file {path}: {exc}") from None
        return cls.from_dict(payload, origin=f"tokenizer file {path}")


def _is_char_payload(payload) -> bool:
    """True when a decoded JSON value has the shape written by CharTokenizer.save."""
    if not isinstance(payload, dict) or payload.get("kind") != "char":
        return False
    chars = payload.get("chars")
    return isinstance(chars, list) and all(isinstance(c, str) and len(c) == 1 for c in chars)
