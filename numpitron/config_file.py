"""--config FILE.toml: every command-line flag as a key in a file, and the file a run leaves.

A flag's key is its name with underscores for dashes, in the section named after its
`--help` group:

    [mesh]
    tensor_parallel_size = 2
    [training]
    max_iters = 500
    no_progress = true           # a switch is true (given) or false

The file's values become the parser's defaults, so a flag on the command line still
wins. Each value is checked against its flag (type and choices) before anything runs:
a wrong key or type is one line naming it. A run writes its resolved flags back as
TOML (`config_toml`), with the mesh's derived sizes filled in, so `--config
OUT/config.toml` repeats it.
"""

import argparse
import copy
import difflib
import os
from pathlib import Path

from numpitron.errors import UserError

NOT_KEYS = ("help", "config")             # the file cannot name itself
RUN_CONFIG_NAME = "config.toml"
WRITTEN_BY_US = "# The resolved configuration of a numpitron run."


def keyed_actions(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    """{section (the --help group's title): {key: the flag's action}}."""
    sections = {}
    for group in parser._action_groups:                       # argparse keeps --help's groups here
        for action in group._group_actions:
            names = [o for o in action.option_strings if o.startswith("--")]
            if names and action.dest not in NOT_KEYS:
                sections.setdefault(group.title, {})[names[0][2:].replace("-", "_")] = action
    return sections


def config_path_in(argv) -> str | None:
    """The --config argument of a command line, read before the real parse."""
    pre = _Prescan(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    return known.config


class _Prescan(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


def read_config(path, parser: argparse.ArgumentParser) -> dict:
    """{dest: value} from a TOML file, every key and value checked against `parser`."""
    path = Path(path)
    try:
        import tomllib
    except ModuleNotFoundError:
        raise UserError("--config needs Python 3.11 or newer (the standard library's tomllib)") from None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))    # a byte-order mark (Windows editors) is no error
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read config file {path}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"{path} is not valid TOML: {error}") from None
    sections, values = keyed_actions(parser), {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise UserError(f"{path}: {section} must be inside a section ({_home(section, sections)})")
        if section not in sections:
            raise UserError(f"{path}: unknown section [{section}]; this command's sections: "
                            f"{', '.join(f'[{s}]' for s in sections)}")
        for key, value in table.items():
            if key not in sections[section]:
                raise UserError(f"{path}: unknown key {key} in [{section}] ({_home(key, sections)})")
            action = sections[section][key]
            values[action.dest] = _checked(action, value, f"{path}: [{section}] {key}")
    return values


def _home(key: str, sections: dict) -> str:
    """Where a misplaced or misspelt key belongs, for the error line."""
    homes = [s for s, keys in sections.items() if key in keys]
    if homes:
        return f"it belongs in [{homes[0]}]"
    close = difflib.get_close_matches(key, [k for keys in sections.values() for k in keys], n=1)
    return f"did you mean {close[0]}?" if close else "see --help for the flags"


def _checked(action: argparse.Action, value, where: str):
    """The parsed value a flag takes from a TOML value, or a UserError naming the key."""
    if action.nargs == 0:                         # a switch: store_true / store_false, or --x / --no-x
        if not isinstance(value, bool):
            raise UserError(f"{where} must be true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else action.default
    if isinstance(action.nargs, int):             # a fixed count of values: a TOML array
        if not isinstance(value, list) or len(value) != action.nargs:
            raise UserError(f"{where} must be an array of {action.nargs} values, got {value!r}")
        single = copy.copy(action)
        single.nargs = None
        return [_checked(single, item, where) for item in value]
    kind = action.type or str
    ok = {int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}.get(kind)
    if ok is None:
        raise UserError(f"{where}: this flag cannot be set from a file")
    if not ok:
        wanted = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise UserError(f"{where} must be {wanted}, got {value!r} ({type(value).__name__})")
    value = kind(value)
    if action.choices is not None and value not in action.choices:
        raise UserError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def config_toml(parser: argparse.ArgumentParser, args: argparse.Namespace, leave_out=()) -> str:
    """The parsed flags as a file `read_config` takes back; unset (None) flags and
    `leave_out` (what one invocation does to its directory, e.g. resume) are left out."""
    lines = [WRITTEN_BY_US, "# Repeat it with --config pointing at this file; flags given beside it win.", ""]
    for section, keys in keyed_actions(parser).items():
        entries = []
        for key, action in keys.items():
            value = getattr(args, action.dest)
            if value is None or key in leave_out:
                continue
            if action.nargs == 0:
                value = bool(value) if isinstance(action, argparse.BooleanOptionalAction) else value == action.const
            entries.append(f"{key} = {_toml_value(value)}")
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
