"""Expert parallelism trains exactly like one process holding every expert (float64,
rtol 1e-10, 10 iterations), with dropping and dropless, combined with tp, pp, dp and
ZeRO-1; the all-to-alls move the bytes the routing implies; checkpoints move between
ep sizes; a MoE checkpoint samples."""

import json

import numpy as np
import pytest

from numpitron.checkpoint import load_checkpoint, save_checkpoint
from numpitron.distributed.topology import Topology
from numpitron.experts.moe import MixtureOfExperts
from tests.harness import (TINY_FLAGS, assert_on_every_rank, gathered, check_mesh, error_lines, identical_over, logged_losses,
                           make_trainer, run_script, tiny_model, tiny_train, train_steps)
from tests.layer_checks import make_store, moe_layer_traffic, rand_x
from tests.tolerances import EQUIV_RTOL_FLOAT64, rel_diff

MOE = dict(num_experts=4, moe_top_k=2)


def check_moe_mesh(mesh: dict, **model_overrides):
    """check_mesh with experts: every parameter compared by its global name, every
    expert of every MoE block among them."""
    result = check_mesh(mesh, model={**MOE, **model_overrides})
    if result.params is not None:
        model_cfg = result.trainer.model_cfg
        assert sum(".experts." in k for k in result.params) == 4 * 4 * model_cfg.n_layers // model_cfg.moe_every
    return result.trainer


TWO_RANKS = [(dict(data=2, expert=2), {}),
             (dict(data=2, expert=2, zero_stage=1, bucket_size=3000), dict(moe_capacity_factor=1.0)),
             (dict(tensor=2), dict(moe_capacity_factor=1.0)),
             (dict(pipeline=2, schedule="1f1b"), dict(moe_every=2))]
FOUR_RANKS = [(dict(data=4, expert=4), dict(moe_top_k=1, moe_capacity_factor=1.25)),
              (dict(data=4, expert=2, zero_stage=2), {}),
              (dict(tensor=2, data=2, expert=2), dict(moe_capacity_factor=1.0)),
              (dict(pipeline=2, data=2, expert=2, schedule="1f1b"), {}),
              (dict(pipeline=2, data=2, expert=2, schedule="gpipe", recompute="full"), dict(moe_capacity_factor=1.0))]


def case_id(case):
    mesh, model = case
    return "-".join(f"{k}{v}" for k, v in {**mesh, **model}.items())


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("case", TWO_RANKS, ids=case_id)
def test_two_ranks_match_serial(case):
    check_moe_mesh(case[0], **case[1])


@pytest.mark.parallel(nprocs=4)
@pytest.mark.parametrize("case", FOUR_RANKS, ids=case_id)
def test_four_ranks_match_serial(case):
    trainer = check_moe_mesh(case[0], **case[1])
    topo = trainer.topo
    # the ep group is ep consecutive dp ranks; expert_dp the dp ranks holding the same experts
    assert_on_every_rank({"ep": (gathered(topo.ep_comm, topo.dp_rank),
                                 [topo.dp_rank // topo.ep * topo.ep + e for e in range(topo.ep)]),
                          "expert_dp": (gathered(topo.expert_dp_comm, topo.dp_rank),
                                        list(range(topo.ep_rank, topo.dp, topo.ep))),
                          "experts identical over expert_dp": identical_over(topo.expert_dp_comm,
                                                                           trainer.model.expert_store.data)})


@pytest.mark.parallel(nprocs=2)
def test_all_to_all_bytes_match_the_routing():
    """One forward and backward of a MoE layer on ep = 2, each rank its own tokens: each
    rank sends the rows routed to the other rank's experts (dispatch, and the combine's
    backward) and returns the rows it received (combine, and the dispatch's backward)."""
    topo = Topology.from_world(data=2, expert=2)
    B, T, C, E = 2, 8, 8, 4
    layer = MixtureOfExperts("mlp", C, topo, 0.3, num_experts=E, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01)
    make_store(layer.parameters())                       # the router is the same on both ranks
    x = rand_x((B, T, C), seed=topo.rank)
    sent, received, routing, snap = moe_layer_traffic(layer, x, rand_x((B, T, C), seed=9), E)
    assert_on_every_rank({
        "all_to_allv bytes": (snap["ep.all_to_allv"]["bytes"], 2 * (sent + received) * C * 8),
        "all_to_allv calls": (snap["ep.all_to_allv"]["calls"], 4),
        "counts exchanged once": (snap["ep.all_to_all"]["bytes"], (2 - 1) / 2 * E * 8),
        "something dropped and something sent": (bool(np.any(~routing.kept)) and sent > 0, True),
        "only the ep group talks": (sorted(snap), ["ep.all_to_all", "ep.all_to_allv"]),
    })


@pytest.mark.parallel(nprocs=2)
def test_checkpoints_move_between_ep2_and_ep1(shared_dir):
    model_cfg, train_cfg = tiny_model(n_layers=2, n_heads=2, **MOE, moe_capacity_factor=1.0), tiny_train()
    tokens = np.random.default_rng(0).integers(0, 65, 5000).astype(np.uint16)
    expected = train_steps(make_trainer(model_cfg, train_cfg, Topology.serial()), 6, tokens)
    for source_ep, target_ep in ((2, 1), (1, 2)):
        source = make_trainer(model_cfg, train_cfg, data=2, expert=source_ep, zero_stage=source_ep - 1)
        assert rel_diff(train_steps(source, 3, tokens), expected[:3]) <= EQUIV_RTOL_FLOAT64
        path = save_checkpoint(shared_dir / f"from-ep{source_ep}", source)
        manifest = json.loads((path / "manifest.json").read_text())
        assert "blocks.1.mlp.experts.3.proj.weight" in manifest["tensors"]      # by global index
        resumed = make_trainer(model_cfg, train_cfg, data=2, expert=target_ep)
        load_checkpoint(path, resumed)
        assert resumed.iteration == 3 and all(o.adam.step_count == 3 for o in resumed.optimizers)
        losses = train_steps(resumed, 3, tokens)
        assert rel_diff(losses, expected[3:]) <= EQUIV_RTOL_FLOAT64, (source_ep, target_ep, losses, expected[3:])


def test_train_on_ep2_then_sample_and_bad_input_is_one_line(data_dir, tmp_path):
    out = tmp_path / "out"
    moe = ["--num-experts", "4", "--moe-top-k", "2", "--moe-capacity-factor", "1.0", "--moe-every", "2"]
    common = TINY_FLAGS + moe + ["--data-dir", str(data_dir), "--out-dir", str(out)]
    trained = run_script(common + ["--max-iters", "4", "--expert-parallel-size", "2"], nprocs=2)
    assert trained.returncode == 0, trained.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(logged_losses(out)) == 4
    assert all(np.array(r["moe_tokens_per_expert"]).shape == (1, 4) and 0 <= r["moe_dropped_fraction"] < 1
               for r in rows)
    sampled = run_script(["--out-dir", str(out), "--max-new-tokens", "20", "--prompt", "ROMEO:",
                          "--tensor-parallel-size", "2"], nprocs=2,
                         script="sample.py")
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr[-2000:]
    bad = run_script(common + ["--max-iters", "1", "--num-experts", "3", "--expert-parallel-size", "2"], nprocs=2)
    errors = error_lines(bad.stderr)
    assert bad.returncode != 0 and len(errors) == 1, bad.stderr
    assert "--num-experts (3) must be divisible by the expert-parallel size (2)" in errors[0]
