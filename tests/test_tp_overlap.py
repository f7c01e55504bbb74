"""Tensor-parallel communication overlap (--tp-comm-overlap): the column-parallel input
gradient's collective is started before the weight half and waited for after it,
changes neither a bit of training nor a byte on the wire, and is off when asked."""

import numpy as np
import pytest

from numpitron.distributed.topology import Topology
from numpitron.transformer.mlp import ParallelMLP
from numpitron.nn.param_store import ParamStore
from numpitron.tensor_parallel.regions import ReplicatedRegion
from tests.harness import assert_on_every_rank, check_mesh, make_trainer, mesh_id, tiny_model, tiny_train, train_steps


class RecordingComm:
    """A stand-in tp group that moves nothing and writes down each collective."""
    size, rank = 2, 0

    def __init__(self, events):
        self.events = events

    def all_reduce(self, buf, op="sum"):
        self.events.append("all_reduce")
        return buf

    def iall_reduce(self, buf):
        self.events.append("start")
        return object()

    def wait(self, pending):
        self.events.append("wait")


def mlp_backward_events(overlap: bool, split: bool) -> list[str]:
    events = []
    mlp = ParallelMLP("mlp", 8, Topology.serial(), 0.02, ReplicatedRegion(RecordingComm(events), overlap))
    ParamStore(mlp.parameters(), np.float64, 0).initialize(0)
    for name in ("fc", "proj"):
        layer = getattr(mlp, name)
        halves = layer.backward_weights
        layer.backward_weights = lambda cache, halves=halves, name=name: (events.append(f"{name} W"), halves(cache))
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    _, cache = mlp.forward(x)
    del events[:]                                     # the forward's "g"
    if split:                                         # a zero-bubble schedule: the halves apart
        mlp.backward_input(np.ones_like(x), cache)
        mlp.backward_weights(cache)
    else:
        mlp.backward(np.ones_like(x), cache)
    return events


@pytest.mark.parametrize("overlap, split, expected", [
    (True, False, ["start", "proj W", "fc W", "wait"]),         # the weight half hides the sum
    (False, False, ["all_reduce", "proj W", "fc W"]),
    (True, True, ["start", "wait", "proj W", "fc W"]),          # nothing to hide it behind
])
def test_the_input_gradient_sum_is_waited_for_after_the_weight_half(overlap, split, expected):
    assert mlp_backward_events(overlap, split) == expected


TWO_RANKS = [dict(tensor=2, tp_comm_overlap=False), dict(tensor=2, sequence_parallel=True, tp_comm_overlap=False)]


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("mesh", TWO_RANKS, ids=mesh_id)
def test_without_overlap_matches_serial(mesh):
    check_mesh(mesh)                  # with overlap (the default): test_equivalence.py


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_overlap_changes_no_bit_and_no_byte(sequence_parallel):
    model_cfg, train_cfg = tiny_model(), tiny_train()
    runs = {}
    for overlap in (True, False):
        trainer = make_trainer(model_cfg, train_cfg, tensor=2, sequence_parallel=sequence_parallel,
                               tp_comm_overlap=overlap)
        trainer.topo.stats.reset()
        losses = train_steps(trainer, 3)
        tp_bytes = {k: v["bytes"] for k, v in trainer.topo.stats.snapshot().items() if k.startswith("tp.")}
        runs[overlap] = losses, tp_bytes
    assert_on_every_rank({"losses": (runs[True][0], runs[False][0]), "tp bytes": (runs[True][1], runs[False][1])})


@pytest.mark.parallel(nprocs=2)
def test_sequence_parallel_overlap_in_float64_matches_serial_at_the_batch_of_issue_46():
    # tp = 2, --sequence-parallel, overlap on (the default), micro-batch 12: the
    # reduce-scatter's send buffer was freed, then reused, while MPI still read it.
    check_mesh(dict(tensor=2, sequence_parallel=True, tp_comm_overlap=True), model=dict(seq_len=64, d_model=128, n_layers=2),
               micro_batch_size=12, global_batch_size=12)
