"""python -m numpitron.cluster: a cluster of simulated hosts on this machine.

    python -m numpitron.cluster up --hosts 2 --ranks-per-host 2 --inter-host-rate 200mbit
    python -m numpitron.cluster run -n 4 -- python train_shakespeare.py --tensor-parallel-size 2
    python -m numpitron.cluster run --max-restarts 2 -n 4 -- python train_shakespeare.py --save-interval 100
    python -m numpitron.cluster status
    python -m numpitron.cluster kill-host 1
    python -m numpitron.cluster down

Needs root (network namespaces); see numpitron/cluster/__init__.py and docs/17-many-hosts.md.
"""

import argparse
import signal
import sys

from numpitron.cluster import control, launch
from numpitron.cluster.network import ClusterError, ClusterSpec
from numpitron.cluster.supervisor import supervise
from numpitron.errors import exit_with_one_line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m numpitron.cluster", description=__doc__.split("\n")[0])
    p.add_argument("--prefix", default=control.DEFAULT_PREFIX,
                   help="names of everything the cluster creates start with this (default npt-)")
    sub = p.add_subparsers(dest="action", required=True)
    u = sub.add_parser("up", help="create the hosts and their links")
    u.add_argument("--hosts", type=int, required=True)
    u.add_argument("--ranks-per-host", type=int, required=True)
    u.add_argument("--inter-host-rate", required=True, help="each host's link to the others, tc syntax: 200mbit")
    u.add_argument("--intra-host-rate", default=None,
                   help="give each rank its own namespace and a link of this rate to its host's switch "
                        "(default: the ranks of a host share memory)")
    u.add_argument("--mtu", type=int, default=None,
                   help="largest frame on every link, bytes (default: about 1 ms of the slowest link, within "
                        "1500..65000; Ethernet's is 1500)")
    r = sub.add_parser("run", help="run an MPI command on the cluster, filling the hosts in order")
    r.add_argument("-n", type=int, required=True, help="number of ranks")
    r.add_argument("--per-host", type=int, default=None, help="ranks on each host (default: --ranks-per-host)")
    r.add_argument("--max-restarts", type=int, default=0,
                   help="when a host or rank is lost, restart a training job from its last checkpoint on the "
                        "hosts left, up to this many times (default 0: never)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    sub.add_parser("status", help="print the hosts and their links' byte counters")
    k = sub.add_parser("kill-host", help="take a host off the network and kill its processes")
    k.add_argument("host", type=int)
    sub.add_parser("down", help="remove everything the cluster created (idempotent)")
    return p


def _interrupt(number, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.action == "up":
        spec = control.up(ClusterSpec(args.prefix, args.hosts, args.ranks_per_host, args.inter_host_rate,
                                      args.intra_host_rate, args.mtu))
        print(control.status(spec.prefix))
    elif args.action == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        announce = lambda line: print(line, file=sys.stderr, flush=True)    # noqa: E731
        if args.max_restarts < 0:
            raise ClusterError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
        for number in (signal.SIGTERM, signal.SIGHUP):      # `kill`, a closed terminal: as Ctrl-C
            signal.signal(number, _interrupt)
        try:
            if args.max_restarts:
                return supervise(command, args.n, args.max_restarts, args.prefix, args.per_host, announce)
            return launch.run(command, args.n, args.prefix, args.per_host, announce)
        except KeyboardInterrupt:           # Ctrl-C: the job was ended (run_job); stop, never restart
            announce("error: interrupted; ended the job")
            return 130
    elif args.action == "status":
        print(control.status(args.prefix))
    elif args.action == "kill-host":
        control.kill_host(args.host, args.prefix)
    else:
        control.check_privilege()
        removed = control.down(args.prefix)
        print(f"removed {len(removed)} namespaces" if removed else "nothing to remove")
    return 0


if __name__ == "__main__":
    exit_with_one_line(main)
