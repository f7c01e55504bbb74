"""python -m numpitron.plan: memory, bytes, FLOPs and time of one training iteration of
any model on any mesh, per pipeline stage, before launching it.

    python -m numpitron.plan --tensor-parallel-size 2 --data-parallel-size 2
    python -m numpitron.plan --n-layers 24 --d-model 2304 --n-heads 24 --seq-len 2048 --vocab-size 51200 \\
        --micro-batch-size 1 --global-batch-size 512 --data-parallel-size 32 --device a100-80gb-node
    python -m numpitron.plan --search --devices 4

The flags are the training script's (numpitron/cli.py), plus --vocab-size, --device,
--json, --search, --devices and --trace (the predicted step as a trace,
docs/19-traces.md); a layout that cannot work gets the line training would give, from
the same checks.
"""

import json
from dataclasses import dataclass, replace
from typing import ClassVar

from numpitron.cli import configs_from_args, training_parser
from numpitron.config import ModelConfig
from numpitron.config_fields import setting
from numpitron.layout import check_layout
from numpitron.pipeline_parallel.placement import StagePlacement
from numpitron.distributed.topology import resolve_mesh
from numpitron.errors import UserError, exit_with_one_line
from numpitron.plan.accounting import Rank
from numpitron.plan.layer_sizes import layer_elements
from numpitron.plan.experts import moe_block_elements
from numpitron.plan.devices import load_device
from numpitron.pipeline_parallel.schedules import placement_of
from numpitron.plan.predict import plan


@dataclass(frozen=True)
class PlanningFlags:
    SECTION: ClassVar[str] = "planning"     # the --help group and the section of a --config file

    vocab_size: int = setting(ModelConfig.vocab_size, "65: Tiny Shakespeare's characters")
    device: str = setting("this-machine", "a profile's name (this-machine, a100-80gb-node, h100-80gb-node) or a "
                                          "path to a .json profile")
    json: bool = setting(False, "print one JSON object")
    search: bool = setting(False, "rank every layout of --devices devices")
    devices: int | None = setting(None, "world size (default: the mesh flags' product)")
    trace: str | None = setting(None, "also write the predicted step as a trace, beside a measured one "
                                      "(docs/19-traces.md)", metavar="FILE.json")


def parser():
    p = training_parser("Plan a run: memory, communication, FLOPs and time per rank.")
    p.add_settings(PlanningFlags)
    return p


def layout_of(args, world: int, model, parallel, train):
    mesh = resolve_mesh(world, args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size,
                        args.context_parallel_size, args.expert_parallel_size, args.data_parallel_shard_size)
    check_layout(model, train, mesh, parallel)
    return tuple(mesh)[:4] + (mesh.dp_shard, mesh.ep)      # (tp, pp, dp, cp, S, ep)


def search(args, model, parallel, train, device) -> tuple[list, list]:
    fits, rejected = [], []
    for tp in range(1, args.devices + 1):
        for pp in range(1, args.devices // tp + 1):
            for cp in (c for c in range(1, args.devices // (tp * pp) + 1) if args.devices % (tp * pp * c) == 0):
                trial = replace_args(args, tp, pp, cp)
                label = f"tp={tp} pp={pp} cp={cp} dp={args.devices // (tp * pp * cp)}"
                try:
                    result = plan(model, parallel, train, layout_of(trial, args.devices, model, parallel, train), device)
                    result["parameters"] = sizes(model, parallel, pp)
                except UserError as error:
                    rejected.append((label, str(error)))
                    continue
                (fits if result["fits"] else rejected).append(
                    (label, result) if result["fits"] else (label, "does not fit in the device's memory"))
    fits.sort(key=lambda item: -item[1]["tokens_per_s"])        # the global batch may differ: compare throughput
    return fits, rejected


def replace_args(args, tp, pp, cp):
    trial = type(args)(**vars(args))
    trial.tensor_parallel_size, trial.pipeline_parallel_size, trial.context_parallel_size = tp, pp, cp
    trial.data_parallel_size = None
    return trial


def parameter_counts(model, placement: StagePlacement = StagePlacement(1)) -> dict:
    """The model's size, counted from the layers' own Params (plan/accounting.py):
    `total` (the tied embedding once), `per_stage` (what each pipeline rank holds: its
    chunks' blocks, the embeddings where virtual stage 0 is, the final LayerNorm where
    the last is and, when that is another rank, its copy of the tied embedding for the
    head), and `active_per_token` (an MoE block runs its router, its shared experts and
    top-k of its E routed experts per token)."""
    pieces = {piece: elements for piece, (elements, _) in layer_elements(model, 1).items()}
    every, active = moe_block_elements(model) if model.num_experts else (0, 0)

    def block(i: int, used: bool = False) -> int:
        return (active if used else every) if model.is_moe_block(i) else pieces["block"]
    L = model.n_layers
    outer = pieces["token"] + pieces["position"] + pieces["head"]
    per_stage = []
    for r in range(placement.p):
        rank = Rank(1, placement.p, 1, 1, r, placement=placement)
        blocks = rank.blocks(L)
        per_stage.append(sum(map(block, blocks)) + pieces["token"] * (rank.first or rank.last)
                         + pieces["position"] * rank.first + pieces["head"] * rank.last)
    return {"total": sum(map(block, range(L))) + outer, "per_stage": per_stage,
            "active_per_token": sum(block(i, used=True) for i in range(L)) + outer}


def sizes(model, parallel, pp: int) -> dict:
    """parameter_counts with the stages placed as the schedule places them (a V or a loop)."""
    return parameter_counts(model, placement_of(parallel.schedule, pp, parallel.virtual_stages))


def size_line(counts: dict) -> str:
    active, per_stage = counts["active_per_token"], counts["per_stage"]
    active = "" if active == counts["total"] else f", {active:,} active per token"
    stages = "" if len(per_stage) == 1 else " (per stage " + ", ".join(f"{n:,}" for n in per_stage) + ")"
    return f"{counts['total']:,} parameters{active}{stages}"


def report(result: dict) -> str:
    mesh = result["mesh"]
    hybrid = f" (ZeRO over {mesh['dp_shard']} of them)" if mesh["dp_shard"] < mesh["dp"] else ""
    lines = ["model: " + size_line(result["parameters"]),
             f"mesh tp={mesh['tp']} pp={mesh['pp']} dp={mesh['dp']}{hybrid} cp={mesh['cp']}"
             + (f" ep={mesh['ep']}" if mesh["ep"] > 1 else "") + f" ({mesh['devices']} devices), "
             f"{result['microbatches']} micro-batches, bubble {result['bubble']:.1%}",
             f"model FLOPs per iteration {result['model_flops_per_iteration']:.3e} "
             f"(executed {result['hardware_flops_per_iteration']:.3e})",
             f"predicted step {1e3 * result['step_s']:.1f} ms, {result['tokens_per_s']:,.0f} tokens/s, "
             f"MFU {result['mfu']:.1%}, fits: {result['fits']}"
             + (f" ({result['time_sharing']:g} ranks per core)" if result["time_sharing"] > 1 else "")
             + (f", at the slowest rank's pace x{result['pace']:.2f}" if result["pace"] != 1 else "")]
    if any(kind.startswith("diloco.") for kind in result["stages"][0]["comm_bytes"]):
        lines.append("DiLoCo: inside a replica, the traffic of dp / R ranks; the outer exchange "
                     "(diloco) comes once a round (F times, a fragment each, streaming) and is shown divided by "
                     "its inner steps; its τ overlap steps hide it")
    if result["parameters"]["active_per_token"] != result["parameters"]["total"]:
        lines.append("experts: rows per expert planned for balanced routing (exact when a capacity is "
                     "filled by every expert; dropless, the real rows follow the router)")
    for s in result["stages"]:
        t = s["time_s"]
        lines.append(f"  stage {s['stage']}: params {s['params'] / 2**20:.1f} MiB, grads {s['grads'] / 2**20:.1f} MiB, "
                     f"optimizer {s['optimizer_state'] / 2**20:.1f} MiB, "
                     + (f"DiLoCo {s['diloco'] / 2**20:.1f} MiB, " if "diloco" in s else "")
                     + f"in-pass {(s['gathered_params_peak'] + s['backward_grads_peak']) / 2**20:.1f} MiB, "
                     f"activations {s['activations_peak'] / 2**20:.1f} MiB (peak total {s['total_peak'] / 2**20:.1f} MiB)")
        if "newton_schulz" in s:
            ns = s["newton_schulz"]
            lines.append(f"    Muon: Newton-Schulz {ns['flops_total']:.3e} FLOPs over {len(ns['owner_flops'])} owners, "
                         f"busiest {max(ns['owner_flops']):.3e} (x{ns['imbalance']:.2f} the mean)")
        lines.append("    bytes per iteration, as a flat ring sends them: "
                     + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in s["comm_bytes"].items()))
        lines.append("    per tier, as priced" + (" (hierarchical across hosts)" if result["groups_across_hosts"] else "")
                     + ": " + ", ".join(f"{tier}-host {v['bytes'] / 2**20:.2f} MiB in {1e3 * v['seconds']:.2f} ms"
                                                 for tier, v in sorted(s["tiers"].items()))
                     + f"; groups across hosts: {', '.join(result['groups_across_hosts']) or 'none'}")
        if "all_to_all" in s:
            a = s["all_to_all"]
            lines.append(f"    experts' all-to-alls {1e3 * a['all_to_all']:.2f} ms: exposed {1e3 * a['exposed_unpaired']:.2f} ms "
                         f"unpaired, {1e3 * a['exposed_paired']:.2f} ms in the {a['pairs']} pairs of a forward and a "
                         f"backward chunk this stage runs (each hides min(a2a, the other chunk's compute))")
        lines.append(f"    time: matmul {1e3 * t['matmul']:.1f} ms, element-wise {1e3 * t['elementwise']:.1f} ms, "
                     f"exp {1e3 * t['exp']:.1f} ms, calls {1e3 * t['calls']:.1f} ms, "
                     f"exposed communication {1e3 * t['exposed_comm']:.2f} ms, optimizer {1e3 * t['optimizer']:.2f} ms, "
                     + (f"Newton-Schulz {1e3 * t['newton_schulz']:.1f} ms, " if t["newton_schulz"] else "")
                     + f"bubble {1e3 * t['bubble']:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    model, parallel, train = configs_from_args(args)
    model = replace(model, vocab_size=args.vocab_size).validate()
    if args.devices is not None and args.devices < 1:
        raise UserError(f"--devices must be positive, got {args.devices}")
    device = load_device(args.device)
    if args.search:
        if not args.devices:
            raise UserError("--search needs --devices N")
        fits, rejected = search(args, model, parallel, train, device)
        if args.json:
            print(json.dumps({"fits": [r for _, r in fits], "rejected": rejected}))
            return 0
        for label, result in fits:
            print(f"{label}: {result['tokens_per_s']:,.0f} tokens/s, {1e3 * result['step_s']:.1f} ms, MFU {result['mfu']:.1%}, "
                  f"peak {max(s['total_peak'] for s in result['stages']) / 2**20:.1f} MiB per rank")
        for label, reason in rejected:
            print(f"{label}: rejected: {reason}")
        return 0
    world = args.devices or (args.tensor_parallel_size * args.pipeline_parallel_size * args.context_parallel_size
                             * (args.data_parallel_size or 1))
    result = plan(model, parallel, train, layout_of(args, world, model, parallel, train), device)
    result["parameters"] = sizes(model, parallel, args.pipeline_parallel_size)
    print(json.dumps(result) if args.json else report(result))
    if args.trace:
        from numpitron.trace.predicted import write_predicted
        write_predicted(args.trace, result, parallel.schedule, parallel.virtual_stages)
    return 0


if __name__ == "__main__":
    exit_with_one_line(main)
