"""Keep a training job alive when a host or a rank is lost (docs/17-many-hosts.md,
"Surviving a lost host").

`run --max-restarts N` runs the job as `run` does; when it ends because a host's link
went down (`kill-host`, a pulled cable) or a rank was killed, it starts the job again on
the hosts still up, from the run's last complete checkpoint (`--resume`). The mesh is
planned again for the ranks left: tensor, pipeline and context sizes stay, the
data-parallel size shrinks, and the global batch stays what it was (passed explicitly),
so the run goes on with the same batches and the same trajectory; checkpoints load on
any mesh (docs/16-checkpoints-and-sampling.md). Each restart is one line.

A job that fails on its own (bad flags, a corrupt checkpoint: exit code 1 with no host
lost) is not restarted: it would fail the same way again.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from numpitron.checkpoint.load import latest_checkpoint
from numpitron.checkpoint.manifest import iteration_of
from numpitron.cluster.control import DEFAULT_PREFIX, require
from numpitron.cluster.launch import placement, run_job
from numpitron.cluster.network import ClusterError, host_link_is_up

# Hydra reports a rank that a signal ended (SIGKILL, SIGSEGV) as 128 + the signal or
# as its own failure codes above that; a rank's own error exits with 1.
SIGNAL_EXIT = 128
REPLACED_FLAGS = ("--data-parallel-size", "--global-batch-size")      # each takes a value
REPLACED_SWITCHES = ("--resume", "--overwrite")


@dataclass(frozen=True)
class Job:
    """What the supervisor needs of the training command: its mesh and batch."""
    model_parallel: int            # tp x cp x pp: the ranks one data-parallel replica needs
    expert: int
    data: int
    micro_batch: int
    global_batch: int
    out_dir: Path
    overwrite: bool


def read_job(command: list[str], n: int) -> Job:
    """The command's mesh and global batch, read with the training script's own
    parser (so --config files and defaults count as they do in the job)."""
    from numpitron.cli import add_file_flags, training_parser
    from numpitron.errors import UserError
    parser = training_parser()
    add_file_flags(parser)
    try:
        args, _ = parser.parse_known_args(command)
    except UserError as error:
        raise ClusterError(f"cannot read the training command: {error}") from None
    model_parallel = args.tensor_parallel_size * args.context_parallel_size * args.pipeline_parallel_size
    data = args.data_parallel_size or n // model_parallel
    if model_parallel * data != n:
        raise ClusterError(f"tensor x context x pipeline x data parallel size ({model_parallel} x {data}) "
                           f"does not match the {n} ranks")
    return Job(model_parallel, args.expert_parallel_size, data, args.micro_batch_size,
               args.global_batch_size or args.micro_batch_size * data, Path(args.out_dir), args.overwrite)


def replan(job: Job, ranks_left: int, cause: str) -> int:
    """The largest data-parallel size, at most the job's, that fits the ranks left and
    splits the global batch into whole micro-batches (and whole expert groups)."""
    for data in range(min(job.data, ranks_left // job.model_parallel), 0, -1):
        if job.global_batch % (job.micro_batch * data) == 0 and data % job.expert == 0:
            return data
    raise ClusterError(f"{cause}: cannot restart, the {ranks_left} ranks left fit no mesh with tensor x context x "
                       f"pipeline = {job.model_parallel} ranks per replica and the global batch {job.global_batch} "
                       f"in micro-batches of {job.micro_batch}")


def restart_command(command: list[str], data: int, global_batch: int, resume: bool) -> list[str]:
    """The command with the new data-parallel size, the global batch made explicit,
    and --resume (or --overwrite when no checkpoint was written yet)."""
    kept, args = [], iter(command)
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in REPLACED_FLAGS and "=" not in arg:
            next(args, None)                       # its value
        if name not in REPLACED_FLAGS + REPLACED_SWITCHES:
            kept.append(arg)
    return kept + ["--data-parallel-size", str(data), "--global-batch-size", str(global_batch),
                   "--resume" if resume else "--overwrite"]


def supervise(command: list[str], n: int, max_restarts: int, prefix: str = DEFAULT_PREFIX,
              per_host: int | None = None, announce=print) -> int:
    """Run `command` on n ranks, restarting it up to max_restarts times after a host or
    rank is lost; the job's exit code (0 once it finishes)."""
    spec = require(prefix)
    job, started = read_job(command, n), time.time()
    per_host = per_host or spec.ranks_per_host
    places = placement(spec, n, per_host)
    hosts, data, attempt, restarts = sorted({host for host, _ in places}), job.data, command, 0
    while True:
        code, lost = run_job(spec, attempt, places, quiet_launcher=True)
        lost = lost or [h for h in hosts if not host_link_is_up(spec, h)]
        if code == 0 or (not lost and code <= SIGNAL_EXIT):
            return code
        cause = (f"host {', '.join(f'{h} ({spec.hostname(h)})' for h in lost)} lost" if lost
                 else f"a rank was lost (exit code {code})")
        if restarts == max_restarts:
            announce(f"error: {cause}; no restarts left (--max-restarts {max_restarts})")
            return code or 1
        restarts += 1
        hosts = [h for h in hosts if h not in lost]
        new_data = replan(job, len(hosts) * per_host, cause)
        checkpoint = latest_checkpoint(job.out_dir / "checkpoints")
        if checkpoint is not None and job.overwrite and checkpoint.stat().st_mtime < started:
            checkpoint = None           # the run --overwrite replaced wrote it, not this one
        attempt = restart_command(command, new_data, job.global_batch, resume=checkpoint is not None)
        places = placement(spec, new_data * job.model_parallel, per_host, hosts)
        where = (f"from {checkpoint.name} (iteration {iteration_of(checkpoint)})" if checkpoint
                 else "from the start (no checkpoint yet)")
        announce(f"restart {restarts} of {max_restarts}: {cause}; {where} on host{'s' * (len(hosts) > 1)} "
                 f"{', '.join(map(str, hosts))} with {len(places)} ranks, data-parallel {data} -> {new_data}, "
                 f"global batch {job.global_batch}")
        data = new_data
