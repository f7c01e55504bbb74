"""The experts' all-to-alls, non-blocking (--moe-a2a-overlap): the shared experts are
computed while the dispatch travels (and their input gradient while the output gradient
travels to the experts), the router's backward while the input gradients come back.
Overlap on and off both train exactly like one process (float64, 1e-10), and move the
same bytes in the same calls."""

import numpy as np
import pytest

from numpitron.build import build_stage
from numpitron.distributed.topology import Topology
from numpitron.experts.moe import MixtureOfExperts
from tests.harness import assert_on_every_rank, check_mesh, tiny_model
from tests.layer_checks import make_store, moe_layer_traffic, rand_x

SHARED = dict(num_experts=4, moe_top_k=2, moe_shared_experts=2, moe_expert_hidden=24)
B, T, C, E = 2, 8, 8, 4


def moe_layer(topo, overlap: bool):
    layer = MixtureOfExperts("mlp", C, topo, 0.3, num_experts=E, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01,
                             shared_experts=1, expert_hidden=16, a2a_overlap=overlap)
    make_store(layer.parameters())
    return layer


def test_the_flag_reaches_the_layers_through_the_stage_experts():
    for overlap in (True, False):
        stage = build_stage(tiny_model(**SHARED), Topology.serial(), moe_a2a_overlap=overlap)
        assert [layer.dispatcher.overlap for layer in stage.experts.layers] == [overlap] * 4


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_ep2_matches_serial(overlap):
    check_mesh(dict(data=2, expert=2, moe_a2a_overlap=overlap), model=SHARED)


@pytest.mark.parallel(nprocs=2)
def test_overlap_on_and_off_same_outputs_bytes_and_calls_and_the_filler_runs_while_the_rows_travel():
    topo = Topology.from_world(data=2, expert=2)
    x, dy = rand_x((B, T, C), seed=topo.rank), rand_x((B, T, C), seed=9)
    results, events, mode = {}, [], []
    comm = topo.ep_comm
    wait = comm.wait
    comm.wait = lambda pending: (events.append((mode[-1], "wait")), wait(pending))[1]
    for overlap in (True, False):
        mode.append(overlap)
        layer = moe_layer(topo, overlap)
        forward, backward_input = layer.shared.forward, layer.shared.backward_input
        layer.shared.forward = lambda *a, f=forward: (events.append((mode[-1], "shared")), f(*a))[1]
        layer.shared.backward_input = lambda *a, f=backward_input: (events.append((mode[-1], "shared")), f(*a))[1]
        _, _, _, snap = moe_layer_traffic(layer, x, dy, E)
        y, cache = layer.forward(x)
        results[overlap] = (y, layer.backward(dy, cache), snap, layer.experts.parameters()[0].grad.copy())
    comm.wait = wait
    on, off = results[True], results[False]
    order = {overlap: [e for o, e in events if o == overlap][:6] for overlap in (True, False)}
    assert_on_every_rank({
        "same output": (np.array_equal(on[0], off[0]), True),
        "same input gradient": (np.array_equal(on[1], off[1]), True),
        "same expert weight gradient": (np.array_equal(on[3], off[3]), True),
        "same bytes and calls": ({k: (v["bytes"], v["calls"]) for k, v in on[2].items()},
                                 {k: (v["bytes"], v["calls"]) for k, v in off[2].items()}),
        "four all_to_allv": (on[2]["ep.all_to_allv"]["calls"], 4),
        # forward: dispatch (shared meanwhile), combine; backward: dispatch (shared meanwhile), combine
        "overlap: the shared experts before the wait": (order[True],
                                                         ["shared", "wait", "wait", "shared", "wait", "wait"]),
        "no overlap: the wait first": (order[False], ["wait", "shared", "wait", "wait", "shared", "wait"]),
    })


@pytest.mark.parallel(nprocs=4)
def test_ep_by_tp_matches_serial_with_and_without_overlap():
    for overlap in (True, False):
        check_mesh(dict(tensor=2, data=2, expert=2, moe_a2a_overlap=overlap), model={**SHARED, "moe_capacity_factor": 1.0})


@pytest.mark.parallel(nprocs=2)
def test_a_trace_shows_the_all_to_alls_in_flight_with_the_counted_bytes():
    from numpitron.trace.comm_probe import CommProbe
    from numpitron.trace.recorder import Recorder
    topo = Topology.from_world(data=2, expert=2)
    layer, rec = moe_layer(topo, True), Recorder()
    probe = CommProbe(rec, topo)
    probe.install()
    rec.active = True
    x = rand_x((B, T, C), seed=topo.rank)
    topo.stats.reset()
    layer.backward(rand_x((B, T, C), seed=9), layer.forward(x)[1])
    probe.uninstall()
    in_flight = [s for s in rec.spans if s[2] == "ep in flight"]
    assert_on_every_rank({
        "four started": ([s[0] for s in in_flight], ["ep.all_to_allv"] * 4),
        "each completed": (all(s[4] is not None for s in in_flight), True),
        "bytes as counted": (sum(s[5]["bytes"] for s in in_flight), topo.stats.bytes["ep.all_to_allv"]),
    })
