"""The character tokenizer in the Hugging Face `tokenizers` JSON format (tokenizer.json).

`tokenizers` runs a pipeline: normalizer, pre-tokenizer, model, decoder. One token per
character needs only two of them: a pre-tokenizer that cuts the text into single
characters (a regex matching any one character, newlines included, each match its own
piece) and a word-level model that maps each piece to its id. The default decoder would
join tokens with spaces; `Fuse` joins them with nothing, so decode(encode(text)) is text.
An unknown character is an error there as it is in CharTokenizer (no unknown token in
the vocabulary).
"""

from numpitron.data.tokenizer import CharTokenizer
from numpitron.errors import UserError

ANY_ONE_CHARACTER = r"[\s\S]"        # "." would not match a newline


def tokenizer_json(tokenizer: CharTokenizer) -> dict:
    """The tokenizer.json of `tokenizer`: ids are CharTokenizer's, the sorted characters."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": ANY_ONE_CHARACTER},
                          "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": {c: i for i, c in enumerate(tokenizer.chars)},
                  "unk_token": "<unk>"},
    }


def chars_from_tokenizer_json(payload, origin: str) -> list[str]:
    """The characters by id of a one-character-per-token tokenizer.json (as exported, or
    any word-level or merge-free BPE vocabulary of single characters)."""
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, dict) or model.get("type") not in ("WordLevel", "BPE"):
        raise UserError(f"{origin}: expected a WordLevel (or BPE) tokenizer model")
    if model.get("type") == "BPE" and model.get("merges"):
        raise UserError(f"{origin}: a BPE tokenizer with merges makes multi-character tokens; "
                        f"numpitron's GPT reads one token per character")
    if payload.get("added_tokens"):
        raise UserError(f"{origin}: added (special) tokens are not supported by the character tokenizer")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise UserError(f"{origin}: the model's vocab must map tokens to integer ids")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise UserError(f"{origin}: token ids must be 0 .. {len(vocab) - 1}, each once")
    long = [t for t in vocab if len(t) != 1]
    if long:
        raise UserError(f"{origin}: every token must be one character; found {long[:3]!r}")
    by_id = sorted(vocab, key=vocab.get)
    return by_id
