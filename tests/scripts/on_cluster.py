"""What tests/test_cluster.py runs on the simulated hosts, through `cluster run`:

    on_cluster.py placement            rank 0 prints the hosts and which mesh axes cross them
    on_cluster.py equivalence          dp, tp, pp, cp, ZeRO-3, HSDP and experts across 2 hosts x 2 ranks
                                       against one process (float64, 10 iterations)
    on_cluster.py bytes '{"data": 2}'  one step's bytes on host 0's link, beside the formula
    on_cluster.py replica_bytes '{"data": 4, "data_shard": 2, "zero_stage": 3}'
                                       the same for hybrid sharding, whose only traffic across
                                       hosts is dp_replica's: host 0's ranks' formula for it
    on_cluster.py loop                 trains until killed (for the lost-link test)

Run from the repository root with it on PYTHONPATH (the tests' helpers are imported).
"""

import json
import sys
import time
from pathlib import Path

from numpitron.distributed.launch import run_main


def placement():
    from tests.harness import make_trainer
    topo = make_trainer(tensor=2, data=2).topo
    if topo.rank == 0:
        print(json.dumps({"hostnames": topo.hostnames, "crossing": topo.groups_across_hosts(),
                          "printout": str(topo)}), flush=True)


def equivalence():
    from mpi4py import MPI
    from tests.harness import check_mesh
    layouts = [dict(tensor=2, data=2, bucket_size=2000),                 # tp in a host, dp across
               dict(tensor=2, pipeline=2, schedule="1f1b"),              # pp across
               dict(context=2, data=2, zero_stage=3),                    # cp in a host, ZeRO-3 across
               dict(tensor=4),                                           # tp across
               dict(data=4, data_shard=2, zero_stage=3)]                 # HSDP: shard in a host, replicas across
    for mesh in layouts:
        check_mesh(mesh)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"same as one process: {mesh}", flush=True)
    check_mesh(dict(data=4, expert=2), model=dict(num_experts=4, moe_top_k=2, moe_capacity_factor=1.0))  # all-to-all in a host, expert dp across
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("same as one process: experts data=4 expert=2", flush=True)


def link_counters() -> dict:
    """This host's link, read inside its namespace (eth0: all a host sends to others)."""
    stats = Path("/sys/class/net/eth0/statistics")
    return {f"{d}_{u}": int((stats / f"{d}_{u}").read_text()) for d in ("tx", "rx") for u in ("bytes", "packets")}


def measured_step(mesh_json: str):
    """(trainer, this host's link counters' change over one step, the planner's bytes for
    this rank): the step after a first one, which sets up the connections."""
    from mpi4py import MPI
    from numpitron.plan.accounting import Rank
    from numpitron.plan.traffic import comm_bytes
    from tests.harness import make_trainer, tiny_tokens
    trainer, tokens, world = make_trainer(**json.loads(mesh_json)), tiny_tokens(), MPI.COMM_WORLD
    trainer.train_step(tokens)               # connections are set up during the first step
    world.Barrier()
    time.sleep(0.3)                          # the barrier's last acknowledgements
    before = link_counters()
    trainer.topo.stats.reset()
    trainer.train_step(tokens)
    world.Barrier()
    time.sleep(0.3)
    after = link_counters()
    topo = trainer.topo
    formula = comm_bytes(trainer.model_cfg, trainer.parallel_cfg, trainer.train_cfg,
                         Rank.of(topo, trainer.parallel_cfg))
    return trainer, {k: after[k] - before[k] for k in after}, formula


def step_bytes(mesh_json: str):
    trainer, link, formula = measured_step(mesh_json)
    if trainer.topo.rank == 0:
        print(json.dumps({"link": link, "formula": formula, "counted": trainer.topo.stats.total_bytes()}), flush=True)


def replica_bytes(mesh_json: str):
    trainer, link, formula = measured_step(mesh_json)
    topo = trainer.topo
    mine = {"formula": formula.get("dp_replica.all_reduce", 0.0),
            "counted": topo.stats.bytes["dp_replica.all_reduce"], "host": topo.hostnames[topo.rank]}
    everyone = topo.world.mpi.gather(mine, root=0)
    if topo.rank == 0:
        host0 = [r for r in everyone if r["host"] == topo.hostnames[0]]
        print(json.dumps({"link": link, "formula": sum(r["formula"] for r in host0),
                          "counted": sum(r["counted"] for r in host0), "ranks_on_host": len(host0)}), flush=True)


def loop():
    from mpi4py import MPI
    from tests.harness import make_trainer, tiny_tokens
    trainer, tokens = make_trainer(data=2), tiny_tokens()
    for step in range(10**6):
        trainer.train_step(tokens)
        if step == 0 and MPI.COMM_WORLD.Get_rank() == 0:
            print("training", flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    {"placement": placement, "equivalence": equivalence, "bytes": step_bytes, "replica_bytes": replica_bytes,
     "loop": loop}[argv[0]](*argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
