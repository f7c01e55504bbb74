"""The planner states the model's size: its counts equal the parameters a real model
holds, in total, per pipeline stage, and active per token with experts."""

import json
import math
import subprocess
import sys

import pytest
from mpi4py import MPI

from numpitron.config import ParallelConfig
from numpitron.distributed.gather import saved_params
from numpitron.distributed.topology import Topology
from numpitron.build import build_stage
from numpitron.plan.__main__ import parameter_counts
from tests.conftest import REPO
from tests.harness import tiny_model

MOE = dict(num_experts=4, moe_top_k=1, moe_every=2)
SHARED = dict(MOE, moe_shared_experts=1, moe_expert_hidden=16)     # DeepSeekMoE's shared and narrower experts


def held(model) -> int:
    return sum(math.prod(p.logical_shape) for p in model.parameters())


@pytest.mark.parametrize("experts", [{}, MOE, SHARED], ids=["dense", "experts", "shared-experts"])
def test_total_and_active_equal_a_real_models_parameters(experts):
    model_cfg = tiny_model(**experts)
    model = build_stage(model_cfg, Topology.serial())
    stored = sum(math.prod(p.logical_shape) for store in model.stores for p in saved_params(model, store))
    # Per token an MoE block runs top-k of its experts: leave out experts k .. E-1.
    idle = sum(math.prod(p.logical_shape) for p in model.parameters()
               if ".experts." in p.name and int(p.name.split(".experts.")[1].split(".")[0]) >= model_cfg.moe_top_k)
    counts = parameter_counts(model_cfg)
    assert counts == {"total": stored, "per_stage": [held(model)], "active_per_token": stored - idle}
    assert (idle > 0) == bool(experts)


def test_gpt2_small_has_its_published_size():
    from numpitron.config import ModelConfig
    gpt2 = ModelConfig(vocab_size=50257, seq_len=1024, n_layers=12, n_heads=12, d_model=768)
    assert parameter_counts(gpt2)["total"] == 124_439_808          # GPT2LMHeadModel's num_parameters()


def test_the_planner_prints_the_size_and_puts_it_in_json():
    args = [sys.executable, "-m", "numpitron.plan", "--pipeline-parallel-size", "2"]
    text = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=60).stdout
    result = json.loads(subprocess.run(args + ["--json"], capture_output=True, text=True, cwd=REPO, timeout=60).stdout)
    counts = result["parameters"]
    assert text.splitlines()[0] == (f"model: {counts['total']:,} parameters (per stage "
                                    f"{counts['per_stage'][0]:,}, {counts['per_stage'][1]:,})")
    assert counts["total"] == 809_856 == counts["active_per_token"]      # the default model


def test_with_experts_the_json_holds_the_size_and_the_plan():
    args = [sys.executable, "-m", "numpitron.plan", "--num-experts", "4", "--moe-top-k", "2",
            "--data-parallel-size", "2", "--expert-parallel-size", "2", "--json"]
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=60)
    plan = json.loads(result.stdout)
    counts = plan["parameters"]
    assert result.returncode == 0 and counts["active_per_token"] < counts["total"]
    assert plan["mesh"]["ep"] == 2 and plan["stages"][0]["comm_bytes"]["ep.all_to_allv"] > 0 and plan["step_s"] > 0


@pytest.mark.parallel(nprocs=2)
@pytest.mark.parametrize("schedule, experts", [("1f1b", {}), ("interleaved", MOE), ("zb-v", {})],
                         ids=["1f1b", "interleaved-experts", "zb-v"])
def test_per_stage_counts_equal_what_each_pipeline_rank_holds(schedule, experts):
    from numpitron.plan.__main__ import sizes
    model_cfg = tiny_model(**experts)
    parallel = ParallelConfig(schedule=schedule, virtual_stages=2 if schedule == "interleaved" else 1).validate()
    topo = Topology.from_world(1, 2, 1)
    model = build_stage(model_cfg, topo, virtual_stages=parallel.virtual_stages, v_shape=parallel.v_shaped)
    per_rank = MPI.COMM_WORLD.allgather(held(model))
    assert per_rank == sizes(model_cfg, parallel, 2)["per_stage"]
