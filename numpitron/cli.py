"""Command-line flags shared by every entry point, and the one function that turns
them (and the MPI world) into validated configs and a Topology.

Every flag is declared once, as a field of a dataclass whose SECTION names its --help
group and its section of a --config file (config_fields.py): ModelConfig, ParallelConfig
and TrainConfig (config.py) declare theirs; MeshFlags and FileFlags below declare the
flags no config holds; sample.py and the planner declare their own sections."""

import argparse
import math
from dataclasses import dataclass
from typing import ClassVar

from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
from numpitron.config_fields import flags_of, from_args, setting
from numpitron.layout import check_layout
from numpitron.distributed.watchdog import DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S
from numpitron.errors import UserError
from numpitron.runtime import prescan


@dataclass(frozen=True)
class MeshFlags:
    """The mesh's sizes and two settings of every rank's process. Like FileFlags, only a
    declaration: the values stay on the parsed args (mesh_from_args resolves the sizes,
    and the Topology then holds them)."""

    SECTION: ClassVar[str] = "mesh"

    tensor_parallel_size: int = setting(1)
    pipeline_parallel_size: int = setting(1)
    context_parallel_size: int = setting(1, "ranks that split every sequence (ring attention)")
    data_parallel_size: int | None = setting(None, "default: world / (tp * cp * pp)")
    expert_parallel_size: int = setting(1, "data x context parallel ranks that split the experts among them "
                                           "(must divide dp x cp)")
    data_parallel_shard_size: int | None = setting(None, "hybrid sharding: dp ranks that shard ZeRO's state, on one "
                                                         "host (must divide dp; default dp); the dp / S replicas "
                                                         "average across hosts")
    blas_threads: int = setting(1, "BLAS threads per rank (read before NumPy starts)")      # runtime.py
    collective_timeout: float = setting(DEFAULT_TIMEOUT_S, "a rank that waits longer in one collective ends the "
                                        f"job, naming itself and the collective (0: wait forever; else at least "
                                        f"{MIN_TIMEOUT_S:g})", metavar="SECONDS")


@dataclass(frozen=True)
class FileFlags:
    """Where the training script reads its data and writes its run."""

    SECTION: ClassVar[str] = "files"

    data_dir: str = setting("data", "where tinyshakespeare.txt and the prepared files live")
    input: str | None = setting(None, "a local tinyshakespeare.txt to use instead of downloading")
    out_dir: str = setting("out", "metrics.jsonl and checkpoints")
    resume: bool = setting(False, "continue from the latest checkpoint in --out-dir")
    overwrite: bool = setting(False, "replace the run in --out-dir (its metrics.jsonl and the checkpoints this "
                                     "library wrote)")
    reseed: bool = setting(False, "with --resume: allow a --seed other than the checkpoint's run's (its batches "
                                  "from here on differ from that run's)")
    no_progress: bool = setting(False, "no progress bar")
    trace: str | None = setting(None, "write a trace of some iterations to this file, for Perfetto "
                                      "(ui.perfetto.dev): every rank's computation and communication "
                                      "(docs/19-traces.md)", metavar="FILE.json")
    trace_iters: str | None = setting(None, "the iterations --trace records, A to B-1 as metrics.jsonl numbers "
                                            "them (default: the 3 after the run's first)", metavar="A:B")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose flags come from declarations (`add_settings`), whose errors are a
    UserError (one line, printed by one rank) and whose --help is printed by rank 0 only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = {}          # {section: {key: Flag}}: what a --config file may set
        self.flag_actions = {}      # {key: the argparse action of its flag}
        self.takes_config = False   # add_config_flag

    def add_settings(self, declared) -> None:
        """The flags a dataclass declares, as a --help group named by its SECTION."""
        group, keys = self.add_argument_group(declared.SECTION), self.sections.setdefault(declared.SECTION, {})
        for flag in flags_of(declared):
            keys[flag.key] = flag
            if flag.switch == "both":
                options = dict(action=argparse.BooleanOptionalAction, default=flag.default)
            elif flag.switch:       # "--x" switches on, "--no-x" off; either stores the field
                options = dict(action="store_true" if flag.switch == "on" else "store_false", dest=flag.dest)
            else:
                options = dict(type=flag.type, default=flag.default, choices=flag.choices, nargs=flag.count,
                               metavar=flag.metavar)
            text = flag.help and flag.help.replace("%", "%%")     # plain text: argparse would %-format it
            self.flag_actions[flag.key] = group.add_argument(flag.option, help=text, **options)

    def error(self, message):
        raise UserError(message)

    def parse_known_args(self, args=None, namespace=None):
        # --config FILE.toml: the file's values become defaults, so flags still win.
        if self.takes_config:
            from numpitron.config_file import read_config
            path = prescan(args, "--config").config
            if path is not None:
                self.set_defaults(**read_config(path, self))
        return super().parse_known_args(args, namespace)

    def print_help(self, file=None):
        from numpitron.distributed.launch import world_rank_and_size
        if world_rank_and_size()[0] == 0:
            super().print_help(file)


def add_config_flag(p: ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml",
                   help="flags from a file: each flag's name with underscores as a key, in the section of its "
                        "group below (configs/ has examples); flags given here win")
    p.takes_config = True


def add_mesh_flags(p: ArgumentParser) -> None:
    p.add_settings(MeshFlags)


def add_model_flags(p: ArgumentParser) -> None:
    p.add_settings(ModelConfig)


def add_file_flags(p: ArgumentParser) -> None:
    p.add_settings(FileFlags)


def training_parser(description: str = "Train a GPT on Tiny Shakespeare on any mesh.") -> ArgumentParser:
    """The training script's flags. The benchmark adds its own to the same parser with plain
    add_argument: those are not declared, so a --config file cannot set them."""
    p = ArgumentParser(description=description)
    add_config_flag(p)
    for declared in (MeshFlags, ParallelConfig, ModelConfig, TrainConfig):
        p.add_settings(declared)
    return p


def configs_from_args(args) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """Each config validated on its own (no mesh yet). The vocabulary size is filled
    in from the tokenizer later; nothing checked here depends on it."""
    return (from_args(ModelConfig, args).validate(), from_args(ParallelConfig, args).validate(),
            from_args(TrainConfig, args).validate())


def mesh_from_args(args, world_size: int, model: ModelConfig, train: TrainConfig | None,
                   parallel: ParallelConfig | None = None):
    """The Mesh for this world, after every check that involves it."""
    from numpitron.distributed.topology import resolve_mesh
    if args.blas_threads < 1:
        raise UserError(f"--blas-threads must be positive, got {args.blas_threads}")
    timeout = args.collective_timeout
    if not math.isfinite(timeout) or timeout < 0 or 0 < timeout < MIN_TIMEOUT_S:
        # A deadline shorter than a busy rank's pause would end a healthy job blaming a peer.
        raise UserError(f"--collective-timeout must be 0 (wait forever) or a finite number of seconds >= "
                        f"{MIN_TIMEOUT_S:g}, got {timeout}")
    mesh = resolve_mesh(world_size, args.tensor_parallel_size, args.pipeline_parallel_size,
                        args.data_parallel_size, args.context_parallel_size, args.expert_parallel_size,
                        args.data_parallel_shard_size)
    check_layout(model, train, mesh, parallel)
    return mesh


def setup_training(args, world=None):
    """(model, parallel, train configs, Topology) from the parsed flags: every check
    runs identically on every rank, then the communicators are split."""
    from mpi4py import MPI

    from numpitron.distributed.topology import Topology
    world = world or MPI.COMM_WORLD
    model, parallel, train = configs_from_args(args)
    mesh = mesh_from_args(args, world.Get_size(), model, train, parallel)
    if train.diloco_replicas:       # a Topology over each replica's ranks (diloco/replicas.py)
        from numpitron.diloco.replicas import replica_topology
        return model, parallel, train, replica_topology(world, mesh, train.diloco_replicas, args.collective_timeout,
                                                        parallel.ulysses_group(mesh.cp))
    return model, parallel, train, Topology.from_mesh(world, mesh, args.collective_timeout,
                                                      parallel.ulysses_group(mesh.cp))
