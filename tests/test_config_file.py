"""--config FILE.toml for the training script, sample.py and the planner; the shipped
configs/; the config.toml a run leaves (it repeats the run); plain progress lines when
standard output is not a terminal."""

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from numpitron.cli import add_file_flags, configs_from_args, mesh_from_args, training_parser
from numpitron.config_file import config_toml, keyed_actions, read_config, write_run_config
from numpitron.errors import UserError
from tests.conftest import REPO, shakespeare_text_path

CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def sample_parser():
    spec = importlib.util.spec_from_file_location("sample_script", REPO / "sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parser()


def train_parser():
    parser = training_parser()
    add_file_flags(parser)
    return parser


def plan_parser():
    from numpitron.plan.__main__ import parser
    return parser()


PARSERS = {"train": train_parser, "sample": sample_parser, "plan": plan_parser}


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", PARSERS)
def test_every_flag_has_a_key_in_its_help_group_and_the_written_file_reads_back(command, tmp_path):
    parser = PARSERS[command]()
    sections = keyed_actions(parser)
    # One key per flag; a --x / --no-x pair is one flag.
    flags = {next(o for o in a.option_strings if o.startswith("--")) for a in parser._actions
             if any(o.startswith("--") for o in a.option_strings)} - {"--help", "--config"}
    keys = {f"--{k.replace('_', '-')}" for keys in sections.values() for k in keys}
    assert keys == flags
    assert "options" not in sections            # every flag sits in a named group
    # Every value different from its default, then written and read back by a fresh parser.
    changed = parser.parse_args([])
    for keys in sections.values():
        for action in keys.values():
            if action.nargs == 0:
                setattr(changed, action.dest, not action.default if isinstance(action, argparse.BooleanOptionalAction)
                        else action.const)
            elif action.choices:
                setattr(changed, action.dest, [c for c in action.choices if c != action.default][0])
            elif isinstance(action.nargs, int):         # a fixed count of values (--rampup-batch-size)
                setattr(changed, action.dest, [action.type(k + 3) for k in range(action.nargs)])
            elif action.type in (int, float):
                setattr(changed, action.dest, action.type((action.default or 0) + 3))
            else:
                setattr(changed, action.dest, 'a "quoted"\\ line\n\tand é, \x7f')
    path = write(tmp_path, config_toml(parser, changed))
    assert vars(PARSERS[command]().parse_args(["--config", str(path)])) == {**vars(changed), "config": str(path)}


def test_flags_on_the_command_line_win_over_the_file(tmp_path):
    path = write(tmp_path, "[training]\nmax_iters = 7\nlr = 1\n[parallelism]\nno_overlap_grad_reduce = true\n")
    args = train_parser().parse_args(["--config", str(path), "--max-iters", "9"])
    assert (args.max_iters, args.lr, args.overlap_grad_reduce) == (9, 1.0, False)
    assert isinstance(args.lr, float)
    assert train_parser().parse_args([f"--config={path}"]).max_iters == 7


@pytest.mark.parametrize("text, fragment", [
    ("[training]\nmax_iter = 7\n", "unknown key max_iter in [training] (did you mean max_iters?)"),
    ("[model]\nmax_iters = 7\n", "unknown key max_iters in [model] (it belongs in [training])"),
    ("max_iters = 7\n", "max_iters must be inside a section (it belongs in [training])"),
    ("[trainng]\nmax_iters = 7\n", "unknown section [trainng]"),
    ("[training]\nmax_iters = \"7\"\n", "[training] max_iters must be an integer, got '7' (str)"),
    ("[training]\nmax_iters = 7.0\n", "[training] max_iters must be an integer, got 7.0 (float)"),
    ("[training]\nmax_iters = true\n", "[training] max_iters must be an integer, got True (bool)"),
    ("[training]\nlr = \"fast\"\n", "[training] lr must be a number"),
    ("[model]\ndtype = \"float16\"\n", "[model] dtype must be one of float32, float64, got 'float16'"),
    ("[parallelism]\nsequence_parallel = 1\n", "[parallelism] sequence_parallel must be true or false"),
    ("[training\n", "is not valid TOML"),
])
def test_a_wrong_key_or_type_is_one_line_naming_it(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(UserError) as caught:
        train_parser().parse_args(["--config", str(path)])
    assert fragment in str(caught.value) and "\n" not in str(caught.value), caught.value


def test_a_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes("\ufeff[training]\nmax_iters = 7\n".encode("utf-8"))    # as Notepad saves UTF-8
    assert train_parser().parse_args(["--config", str(path)]).max_iters == 7


def test_a_missing_file_and_the_cli_error_are_one_line(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        train_parser().parse_args(["--config", str(tmp_path / "nope.toml")])
    path = write(tmp_path, "[mesh]\ntensor_parallel_size = \"two\"\n")
    for script in ("train_shakespeare.py", "sample.py"):
        done = subprocess.run([sys.executable, script, "--config", str(path)], capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert "[mesh] tensor_parallel_size must be an integer, got 'two' (str)" in done.stderr


def test_blas_threads_from_a_config_file_is_read_before_numpy(tmp_path):
    from numpitron.runtime import blas_threads_from_argv
    path = write(tmp_path, "[mesh]\nblas_threads = 2\n")
    assert blas_threads_from_argv(["--config", str(path)]) == "2"
    assert blas_threads_from_argv(["--config", str(path), "--blas-threads", "3"]) == "3"
    assert blas_threads_from_argv(["--config", str(tmp_path / "missing.toml")]) is None


def first_command(path: Path) -> list[str]:
    return path.read_text().splitlines()[0].lstrip("# ").split()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_each_shipped_config_is_valid_for_the_command_on_its_first_line(path):
    command = first_command(path)
    world = int(command[2]) if command[0] == "mpiexec" else 1
    script = command[command.index("python") + 1]
    assert command[-2:] == ["--config", f"configs/{path.name}"]
    if script == "sample.py":
        assert sample_parser().parse_args(["--config", str(path)]).prompt == "ROMEO:"
        return
    assert script == "train_shakespeare.py"
    args = train_parser().parse_args(["--config", str(path)])
    model, parallel, train = configs_from_args(args)
    mesh_from_args(args, world, model, train, parallel)


def test_the_default_config_is_the_defaults():
    path = REPO / "configs/default.toml"
    args = train_parser().parse_args(["--config", str(path)])
    assert vars(args) == {**vars(train_parser().parse_args([])), "config": str(path)}
    assert len(tomllib.loads(path.read_text())["training"]) == 16


@pytest.mark.parametrize("path", [REPO / "configs/tp2_pp2_zero1.toml", REPO / "configs/shakespeare_char.toml"],
                         ids=lambda p: p.name)
def test_the_planner_takes_a_config(path, capsys):
    from numpitron.plan.__main__ import main
    main(["--config", str(path), "--json"])
    result = json.loads(capsys.readouterr().out)
    file = tomllib.loads(path.read_text())
    assert result["mesh"]["tp"] == file.get("mesh", {}).get("tensor_parallel_size", 1)
    assert result["parameters"]["total"] > 0


def test_a_users_config_toml_in_the_out_dir_is_left_alone(tmp_path):
    (tmp_path / "config.toml").write_text("[training]\nmax_iters = 5\n")
    note = write_run_config(tmp_path, "# The resolved configuration of a numpitron run.\n")
    assert "left" in note and (tmp_path / "config.toml").read_text() == "[training]\nmax_iters = 5\n"


def test_a_run_from_its_config_toml_repeats_it_and_a_log_file_gets_plain_lines(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "tinyshakespeare.txt").write_bytes(shakespeare_text_path().read_bytes())
    tiny = ["--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--seq-len", "16", "--micro-batch-size", "2",
            "--dtype", "float64", "--eval-iters", "1", "--eval-interval", "4", "--log-interval", "2",
            "--max-iters", "6", "--data-dir", str(data)]
    first = subprocess.run([sys.executable, "train_shakespeare.py", *tiny, "--out-dir", str(tmp_path / "a")],
                           capture_output=True, text=True, cwd=REPO, timeout=120)      # stdout is a pipe
    assert first.returncode == 0, first.stderr[-2000:]
    plain = [line for line in first.stdout.splitlines() if re.match(r"iter \d+/6: loss [\d.]+, tok/s [\d,]+$", line)]
    assert [line.split("/")[0] for line in plain] == ["iter 2", "iter 4", "iter 6"], first.stdout
    assert "\r" not in first.stdout + first.stderr                  # no progress bar redrawn into the file
    written = read_config(tmp_path / "a/config.toml", train_parser())
    assert written["max_iters"] == 6 and written["dtype"] == "float64" and written["data_parallel_size"] == 1
    again = subprocess.run([sys.executable, "train_shakespeare.py", "--config", str(tmp_path / "a/config.toml"),
                            "--out-dir", str(tmp_path / "b")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]

    def rows(run):
        return [{k: v for k, v in json.loads(line).items() if k in ("iter", "train_loss", "val_loss", "grad_norm")}
                for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert rows("a") == rows("b") and len(rows("a")) == 3
