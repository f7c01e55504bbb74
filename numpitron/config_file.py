"""--config FILE.toml: every command-line flag as a key in a file, and the file a run leaves.

A flag's key is its name with underscores for dashes, in the section named after its
`--help` group:

    [mesh]
    tensor_parallel_size = 2
    [training]
    max_iters = 500
    no_progress = true           # a switch is true (given) or false

The file's values become the parser's defaults, so a flag on the command line still
wins. Each value is checked against its flag's declaration (type and choices) before
anything runs: a wrong key or type is one line naming it (config_fields.py reads the
file). A run writes its resolved flags back as TOML (`config_toml`), with the mesh's
derived sizes filled in, so `--config OUT/config.toml` repeats it.
"""

import argparse
import os
from pathlib import Path

from numpitron.config_fields import read_file, to_file

RUN_CONFIG_NAME = "config.toml"
WRITTEN_BY_US = "# The resolved configuration of a numpitron run."


def keyed_actions(parser) -> dict[str, dict[str, argparse.Action]]:
    """{section (the --help group's title): {key: the flag's action}}."""
    return {section: {key: parser.flag_actions[key] for key in keys} for section, keys in parser.sections.items()}


def read_config(path, parser) -> dict:
    """{dest: value} from a TOML file, every key and value checked against `parser`'s flags."""
    return read_file(path, parser.sections)


def config_toml(parser, args: argparse.Namespace, leave_out=()) -> str:
    """The parsed flags as a file `read_config` takes back; unset (None) flags and
    `leave_out` (what one invocation does to its directory, e.g. resume) are left out."""
    lines = [WRITTEN_BY_US, "# Repeat it with --config pointing at this file; flags given beside it win.", ""]
    for section, flags in parser.sections.items():
        entries = [f"{key} = {_toml_value(to_file(flag, getattr(args, flag.dest)))}" for key, flag in flags.items()
                   if getattr(args, flag.dest) is not None and key not in leave_out]
        if entries:
            lines += [f"[{section}]", *entries, ""]
    return "\n".join(lines)


def _toml_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)                        # "0.001", "1e-05", "inf": all TOML floats
    return _toml_string(str(value))


def _toml_string(text: str) -> str:
    """A TOML basic string: escape the quote, the backslash and every control character."""
    named = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}
    return '"' + "".join(named.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in text) + '"'


def write_run_config(out_dir, text: str) -> str | None:
    """OUT_DIR/config.toml, replaced atomically, unless a file there is not one a run
    wrote (a user's own config is never overwritten). Returns a note to print, if any."""
    path = Path(out_dir) / RUN_CONFIG_NAME
    try:
        if path.exists() and not path.read_text(encoding="utf-8", errors="replace").startswith(WRITTEN_BY_US):
            return f"left {path} as it is (not written by a run); the resolved configuration was not saved"
        tmp = path.with_name(f".{RUN_CONFIG_NAME}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as error:
        return f"could not write {path}: {error.strerror or error}"
    return None
