"""One declaration per setting: a dataclass field is its flag and its file key.

A field declared with `setting(...)` is a command-line flag. Its name, type (the
annotation) and default are the field's; its help, choices and the like ride in the
field's metadata. Everything else comes from that one declaration:

* the argparse flag, `--` and the name with dashes, in the `--help` group named by the
  class's SECTION (cli.py builds the flags);
* the key of a `--config FILE.toml`, the name with underscores in the [SECTION] table,
  checked against the field's type and choices (`read_file` here; config_file.py writes
  the file a run leaves);
* the copy of the parsed flags into the dataclass (`from_args`).

A field declared plainly (ModelConfig.vocab_size, TrainConfig.eps) is no flag. This
module imports nothing heavy: config.py declares the core's configs with it, and
runtime.py reads a --config file with it before NumPy starts.

    @dataclass(frozen=True)
    class ModelConfig:
        SECTION: ClassVar[str] = "model"
        n_layers: int = setting(4)                          # --n-layers, [model] n_layers
        dtype: str = setting("float32", choices=DTYPES)
"""

import dataclasses
import difflib
import functools
import math
import typing
from pathlib import Path

from numpitron.errors import UserError


@dataclasses.dataclass(frozen=True)
class Flag:
    """A declared setting, resolved to what argparse and a --config file need."""

    field: str                  # the dataclass field it sets
    key: str                    # the flag's words with underscores: the file's key ("pipeline_schedule")
    dest: str                   # the attribute argparse stores it in
    type: type                  # int, float, str or bool: of each value, when it takes several
    default: object             # the flag's default; None: "not given" (a config keeps its field's default)
    help: str | None = None
    choices: tuple | None = None
    count: int | None = None    # takes exactly this many values (in a file: an array), else one
    metavar: str | tuple | None = None
    switch: str | None = None   # a flag without a value: "on" (--x), "off" (--no-x), "both" (--x, --no-x)

    @property
    def option(self) -> str:
        return "--" + self.key.replace("_", "-")


def setting(default, help=None, *, choices=None, flag=None, unset=False, count=None, metavar=None,
            negatable=False):
    """A dataclass field that is also a flag and a file key (the module's docstring).

    flag: the flag's words when they are not the field's ("pipeline-schedule"); on a true
          switch, "no-..." turns the field off (--no-overlap-grad-reduce).
    unset: the flag's default is None, "not given", and leaves the field's default (for a
           default the run derives later, such as micro batch x dp).
    count: the flag takes exactly this many values.
    negatable: a true switch with both --x and --no-x.
    """
    spec = dict(help=help, choices=choices, flag=flag, unset=unset, count=count, metavar=metavar, negatable=negatable)
    return dataclasses.field(default=default, metadata={"setting": spec})


@functools.cache
def flags_of(cls) -> tuple[Flag, ...]:
    """The flags `cls` declares, in field order, its own before a mixin's (TrainConfig's, then
    DiLoCo's: diloco/settings.py): their order in --help and in a written file."""
    hints, flags, own = typing.get_type_hints(cls), [], set(vars(cls).get("__annotations__", {}))
    for field in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):     # stable
        spec = field.metadata.get("setting")
        if spec is None:                          # a plain field: no flag
            continue
        words = spec["flag"] or field.name.replace("_", "-")
        kind, switch = _value_type(hints[field.name]), None
        if kind is bool:
            switch = "both" if spec["negatable"] else "off" if field.default else "on"
            if switch == "off" and not words.startswith("no-"):
                raise TypeError(f"{cls.__name__}.{field.name}: a switch that is on by default needs a no-... flag")
        key = words.replace("-", "_")
        # A --no-x switch stores into the field's own name (False when given), so args.x
        # reads the same as the config's x.
        flags.append(Flag(field=field.name, key=key, dest=field.name if switch == "off" else key, type=kind,
                          default=None if spec["unset"] else field.default, help=spec["help"],
                          choices=spec["choices"], count=spec["count"], metavar=spec["metavar"], switch=switch))
    return tuple(flags)


def _value_type(hint) -> type:
    """int, whether the annotation says int, int | None or tuple[int, ...]."""
    inner = [t for t in typing.get_args(hint) if t is not type(None) and t is not Ellipsis]
    return _value_type(inner[0]) if inner else hint


def from_args(cls, args):
    """`cls` built from parsed flags: each flag's value in its field (None: the field's default)."""
    values = {flag.field: getattr(args, flag.dest) for flag in flags_of(cls)}
    return cls(**{name: value for name, value in values.items() if value is not None})


# --- The --config file ------------------------------------------------------------------------

def parsed_toml(path) -> dict:
    """A TOML file's tables, parsed once per process: runtime.py reads --blas-threads from
    them before NumPy starts and the argument parser the rest. An edited file (another
    modification time or size) is parsed afresh. The tables are shared: read, never change them."""
    path = Path(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except OSError as error:
        raise UserError(f"cannot read config file {path}: {error}") from None
    tables, error = _parse(path, stat.st_mtime_ns, stat.st_size)
    if error:
        raise UserError(error)
    return tables


@functools.lru_cache(maxsize=8)
def _parse(path: Path, mtime_ns: int, size: int) -> tuple[dict, str | None]:
    """(tables, None), or ({}, the error's one line): a bad file is not parsed twice either."""
    try:
        import tomllib
    except ModuleNotFoundError:
        return {}, "--config needs Python 3.11 or newer (the standard library's tomllib)"
    try:
        return tomllib.loads(path.read_text(encoding="utf-8-sig")), None
    except FileNotFoundError:
        return {}, f"config file not found: {path}"
    except (OSError, UnicodeDecodeError) as error:
        return {}, f"cannot read config file {path}: {error}"
    except tomllib.TOMLDecodeError as error:
        return {}, f"{path} is not valid TOML: {error}"


def read_file(path, sections: dict[str, dict[str, Flag]]) -> dict:
    """{dest: value} from a --config file, for a command whose flags are `sections`
    ({section: {key: Flag}}): a misplaced section, an unknown key or a wrong type is one
    line naming the file's key."""
    values = {}
    for section, table in parsed_toml(path).items():
        if not isinstance(table, dict):
            raise UserError(f"{path}: {section} must be inside a section ({_home(section, sections)})")
        if section not in sections:
            raise UserError(f"{path}: unknown section [{section}]; this command's sections: "
                            f"{', '.join(f'[{s}]' for s in sections)}")
        for key, value in table.items():
            if key not in sections[section]:
                raise UserError(f"{path}: unknown key {key} in [{section}] ({_home(key, sections)})")
            flag = sections[section][key]
            values[flag.dest] = from_file(flag, value, f"{path}: [{section}] {key}")
    return values


def _home(key: str, sections: dict) -> str:
    """Where a misplaced or misspelt key belongs, for the error line."""
    homes = [s for s, keys in sections.items() if key in keys]
    if homes:
        return f"it belongs in [{homes[0]}]"
    close = difflib.get_close_matches(key, [k for keys in sections.values() for k in keys], n=1)
    return f"did you mean {close[0]}?" if close else "see --help for the flags"


def from_file(flag: Flag, value, where: str):
    """The value argparse would store for `flag`, from a TOML value, or a UserError naming the key."""
    if flag.switch:                               # a file says true or false, whichever way the flag is spelt
        if not isinstance(value, bool):
            raise UserError(f"{where} must be true or false, got {value!r}")
        return not value if flag.switch == "off" else value
    if flag.count:
        if not isinstance(value, list) or len(value) != flag.count:
            raise UserError(f"{where} must be an array of {flag.count} values, got {value!r}")
        return [from_file(dataclasses.replace(flag, count=None), item, where) for item in value]
    ok = {int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool), str: isinstance(value, str)}
    if not ok[flag.type]:
        wanted = {int: "an integer", float: "a number", str: "a string"}[flag.type]
        raise UserError(f"{where} must be {wanted}, got {value!r} ({type(value).__name__})")
    value = flag.type(value)
    if flag.choices is not None and value not in flag.choices:
        raise UserError(f"{where} must be one of {', '.join(map(str, flag.choices))}, got {value!r}")
    return value


def to_file(flag: Flag, value):
    """What a file says for a flag's parsed value: `from_file` backwards."""
    if flag.switch:
        return not value if flag.switch == "off" else bool(value)
    return value


# --- Checks of a config's values, each naming its field as a flag by default ------------------
# A config read from a file (a checkpoint's manifest) passes `label` to name the file's key instead.

def as_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def integers(cfg, *names, label=as_flag):
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UserError(f"{label(name)} must be an integer, got {value!r} ({type(value).__name__})")


def finite(cfg, *names, label=as_flag):
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise UserError(f"{label(name)} must be a finite number, got {value!r}")


def positive(cfg, *names, label=as_flag):
    for name in names:
        if not getattr(cfg, name) > 0:
            raise UserError(f"{label(name)} must be positive, got {getattr(cfg, name)}")


def non_negative(cfg, *names, label=as_flag):
    for name in names:
        if getattr(cfg, name) < 0:
            raise UserError(f"{label(name)} must not be negative, got {getattr(cfg, name)}")
