"""The planner prices bytes and messages on links: a cluster profile's two tiers, each
pipeline neighbour and ring peer over its own tier, the alpha term per message of each
algorithm (hierarchical ones too), the link fit behind alpha and beta, and what a slow
link leaves exposed."""

import pytest


@pytest.mark.parametrize("mesh, across", [((2, 1, 2, 1), ["dp_cp"]), ((4, 1, 1, 1), ["tp"]),
                                          ((1, 2, 1, 2), ["pp"]), ((1, 1, 4, 1), ["dp_cp"]), ((2, 1, 1, 1), [])])
def test_a_cluster_profile_splits_the_bytes_into_two_tiers(mesh, across):
    """Hosts of two ranks, filled in order: a group stays on one host when the ranks it
    spans divide a host's; its bytes go at that tier's bandwidth."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e8, inter_bandwidth=1e7,
                      intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    result = plan(ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=12), mesh, cluster)
    assert result["groups_across_hosts"] == across
    stage = result["stages"][0]
    whole_world = ["model", "world", "embedding"] if mesh[0] * mesh[1] * mesh[2] * mesh[3] > 2 else []
    inter = sum(v for k, v in stage["comm_bytes"].items() if k.split(".")[0] in across + whole_world)
    total = sum(stage["comm_bytes"].values())
    hierarchical = {(1, 1, 4, 1): "dp_cp.all_reduce", (4, 1, 1, 1): "tp.all_reduce"}.get(mesh)
    inter_seconds = inter / 1e7                 # one rank of each group a host: the whole ring crosses
    if hierarchical:     # two ranks a host: half the buffer inside it, half its share across (links.link_parts)
        ring = stage["comm_bytes"][hierarchical]
        buffer = ring * 4 / 3
        inter += buffer / 2 / 2 - ring
        total += buffer / 2 + buffer / 2 / 2 - ring
        inter_seconds += buffer / 2 / 2 / 1e7 - ring / 1e7
    assert stage["tiers"].get("inter", {}).get("bytes", 0.0) == pytest.approx(inter)
    assert stage["tiers"].get("inter", {}).get("seconds", 0.0) == pytest.approx(inter_seconds)
    assert sum(t["bytes"] for t in stage["tiers"].values()) == pytest.approx(total)


@pytest.mark.parametrize("stage, split", [(0, {"intra": 1.0}), (1, {"intra": 0.5, "inter": 0.5}),
                                          (3, {"intra": 1.0})])
def test_a_stage_sends_to_each_neighbour_over_its_own_tier(stage, split):
    """pp = 4 on hosts of two ranks: stages 0 and 1 share host 0, 2 and 3 host 1. A
    middle stage sends half its bytes (activations on, gradients back) to each
    neighbour, an end stage all to its one; stage 1's next neighbour is across. A
    stage's sends and receives add up: it receives, computes, then sends."""
    from dataclasses import replace

    from numpitron.plan.accounting import Rank
    from numpitron.plan.devices import load_device
    from numpitron.plan.links import point_to_point_time
    bandwidth = {"intra": 1e8, "inter": 1e7}
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=bandwidth["intra"],
                      inter_bandwidth=bandwidth["inter"], intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    comm, calls = {"pp.send": 3e6, "pp.recv": 2e6}, {"pp.send": 1, "pp.recv": 1}
    priced = sum(share * 5e6 / bandwidth[tier] for tier, share in split.items())
    assert point_to_point_time("pp", comm, calls, Rank(1, 4, 1, 1, stage), (1, 4, 1, 1), cluster) == pytest.approx(priced)


def test_a_pipeline_on_links_costs_what_its_messages_add_to_the_timeline():
    """pp = 2 x dp = 2 on hosts of two ranks: only the pipeline's messages cross hosts.
    Slowing the inter-host tier lengthens every stage's step by the same amount, the
    schedule's makespan with the messages on that link less the one with free messages
    (predict.pipeline_transfer_time), which is less than their sum: some hide."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    fast = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e8, inter_bandwidth=1e30,
                   intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    slow = replace(fast, inter_bandwidth=1e7)
    model, parallel, train = ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=2, global_batch_size=16)
    free, paid = (plan(model, parallel, train, (1, 2, 2, 1), d) for d in (fast, slow))
    added = paid["step_s"] - free["step_s"]
    sent = paid["stages"][0]["comm_bytes"]["pp.send"] + paid["stages"][0]["comm_bytes"]["pp.recv"]
    assert 0 < added < sent / 1e7
    for before, after in zip(free["stages"], paid["stages"]):
        assert after["time_s"]["step"] - before["time_s"]["step"] == pytest.approx(added)


@pytest.mark.parametrize("cp_rank", [0, 1, 3])
def test_a_ring_sends_and_receives_at_once_on_a_full_duplex_link(cp_rank):
    """cp = 4 on hosts of two ranks: the ring's last rank (3) sends across to rank 0 and
    receives from rank 2 on its host; on a link both go at once, so the slower counts.
    Through one node's shared memory the rank's core copies both, one after the other."""
    from dataclasses import replace

    from numpitron.plan.accounting import Rank
    from numpitron.plan.devices import load_device
    from numpitron.plan.links import point_to_point_time
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e8, inter_bandwidth=1e7,
                      intra_latency=0.0, inter_latency=0.0, cores_per_node=0)
    comm, calls = {"cp.send": 3e6, "cp.recv": 3e6}, {"cp.send": 6, "cp.recv": 6}
    rank = Rank(1, 1, 1, 4, cp_rank=cp_rank)
    sends_across, receives_across = cp_rank in (1, 3), cp_rank in (0, 2)
    expected = max(3e6 / (1e7 if sends_across else 1e8), 3e6 / (1e7 if receives_across else 1e8))
    assert point_to_point_time("cp", comm, calls, rank, (1, 1, 1, 4), cluster) == pytest.approx(expected)
    one_node = load_device("this-machine")
    assert not one_node.full_duplex() and cluster.full_duplex()
    assert point_to_point_time("cp", comm, calls, rank, (1, 1, 1, 4), one_node) == pytest.approx(
        6e6 / one_node.intra_bandwidth + 12 * one_node.intra_latency)


def test_each_call_pays_alpha_once_per_message_of_its_algorithm():
    """The alpha term by hand, bandwidth made free: tp = 2 x dp = 2 on hosts of two
    ranks, 4 blocks, 3 micro-batches. Inside a host, tp's all-reduces (f and g: 4 a block,
    1 for the embedding, 1 for the head, 3 for the loss, each micro-batch) send 2(2-1)
    messages each. Across hosts dp's one bucket and the loss, and the norm's all-reduce
    (its model group is priced as the whole world's): an all-reduce over 2 ranks, 2
    messages each."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.links import messages
    from numpitron.plan.predict import plan
    alpha_intra, alpha_inter = 1e-3, 1e-2
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e30, inter_bandwidth=1e30,
                      intra_latency=alpha_intra, inter_latency=alpha_inter, cores_per_node=0)
    m, L = 3, 4
    train = TrainConfig(micro_batch_size=2, global_batch_size=2 * m * 2)
    result = plan(ModelConfig(n_layers=L), ParallelConfig(), train,
                  (2, 1, 2, 1), cluster)
    tiers = result["stages"][0]["tiers"]
    assert tiers["intra"]["seconds"] == pytest.approx(m * (4 * L + 1 + 1 + 3) * 2 * alpha_intra)
    assert tiers["inter"]["seconds"] == pytest.approx((1 + 1 + 1) * 2 * alpha_inter)
    assert [messages("x.all_reduce", n) for n in (1, 2, 4, 8)] == [0, 2, 6, 14]
    assert [messages("x.all_gather", 4), messages("x.reduce_scatter", 4), messages("pp.send", 4),
            messages("pp.broadcast", 4), messages("pp.broadcast", 5)] == [3, 3, 1, 2, 3]


def test_a_hierarchical_call_pays_each_tiers_alpha_for_its_ranks_there():
    """dp = 4 on 2 hosts of 2: an all-reduce is 2(2-1) messages inside a host and 2(2-1)
    across, per call (one bucket and the loss)."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    cluster = replace(load_device("this-machine"), ranks_per_host=2, intra_bandwidth=1e30, inter_bandwidth=1e30,
                      intra_latency=1e-3, inter_latency=1e-2, cores_per_node=0)
    result = plan(ModelConfig(), ParallelConfig(), TrainConfig(micro_batch_size=3), (1, 1, 4, 1), cluster)
    tiers = result["stages"][0]["tiers"]
    assert tiers["inter"]["seconds"] == pytest.approx(2 * 2 * 1e-2)
    assert tiers["intra"]["seconds"] == pytest.approx(2 * 2 * 1e-3)


def test_the_link_fit_recovers_alpha_and_beta_from_noisy_all_reduces():
    import numpy as np

    from numpitron.plan.devices import fit_link
    sizes = np.array([8 << s for s in range(0, 16, 3)], float)
    rng = np.random.default_rng(0)
    for ranks, alpha, beta in [(2, 1e-4, 7e6), (4, 3e-5, 9e7)]:
        exact = 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * sizes / beta
        fitted = fit_link(sizes, exact * rng.uniform(0.98, 1.02, sizes.size), ranks)
        assert fitted == pytest.approx((alpha, beta), rel=0.05)


def test_a_slow_link_exposes_what_it_cannot_carry_during_the_backward():
    """dp = 2 in 8 buckets over a link of 1 MB/s: the 3 MB all-reduce takes seconds, the
    backward milliseconds, so nearly all of it is exposed, not one bucket's eighth."""
    from dataclasses import replace

    from numpitron.config import ModelConfig, ParallelConfig, TrainConfig
    from numpitron.plan.devices import load_device
    from numpitron.plan.predict import plan
    slow = replace(load_device("this-machine"), cores_per_node=0, intra_bandwidth=1e6, intra_latency=0.0)
    result = plan(ModelConfig(), ParallelConfig(bucket_size=100_000), TrainConfig(micro_batch_size=12),
                  (1, 1, 2, 1), slow)
    stage = result["stages"][0]
    link = stage["comm_bytes"]["dp_cp.all_reduce"] / 1e6
    compute = sum(stage["time_s"][k] for k in ("matmul", "elementwise", "exp", "calls"))
    assert stage["time_s"]["exposed_comm"] == pytest.approx(result["pace"] * link - 2 / 3 * compute)
