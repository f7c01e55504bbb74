"""DiLoCo's settings checked, before any communication and identically on every rank:
the TrainConfig's fields alone (config.py calls `check_diloco`), then against the mesh
(layout.py calls `check_replicas`)."""

from numpitron.config_fields import finite, integers, non_negative, positive
from numpitron.errors import UserError

OUTER = ("diloco_inner_steps", "diloco_outer_lr", "diloco_outer_momentum", "diloco_fragments",
         "diloco_overlap_steps", "diloco_merge_alpha", "diloco_outer_dtype")
OUTER_DTYPES = ("fp32", "bf16", "int8", "int4")         # how the pseudo-gradients travel (diloco/exchange.py)


def check_diloco(cfg) -> None:
    """The DiLoCo fields of a TrainConfig (config.py), alone: no mesh yet."""
    integers(cfg, "diloco_replicas", "diloco_inner_steps", "diloco_fragments", "diloco_overlap_steps")
    non_negative(cfg, "diloco_replicas", "diloco_overlap_steps")
    positive(cfg, "diloco_inner_steps", "diloco_outer_lr", "diloco_fragments")
    finite(cfg, "diloco_outer_lr", "diloco_outer_momentum", "diloco_merge_alpha")
    changed = [name for name in OUTER if getattr(cfg, name) != getattr(type(cfg), name)]   # from the defaults
    if not cfg.diloco_replicas and changed:
        raise UserError(f"{', '.join('--' + n.replace('_', '-') for n in changed)} set DiLoCo: "
                        "give --diloco-replicas too")
    if not 0 <= cfg.diloco_outer_momentum < 1:
        raise UserError(f"--diloco-outer-momentum must lie in [0, 1), got {cfg.diloco_outer_momentum}")
    if not 0 <= cfg.diloco_merge_alpha <= 1:
        raise UserError(f"--diloco-merge-alpha must lie in [0, 1], got {cfg.diloco_merge_alpha}")
    if cfg.diloco_outer_dtype not in OUTER_DTYPES:
        raise UserError(f"unknown --diloco-outer-dtype {cfg.diloco_outer_dtype!r}; choose one of "
                        f"{', '.join(OUTER_DTYPES)}")
    # Fragment p lands at most tau steps after it left, before its next exchange H steps later.
    if cfg.diloco_fragments > cfg.diloco_inner_steps:
        raise UserError(f"--diloco-fragments ({cfg.diloco_fragments}) must not exceed --diloco-inner-steps "
                        f"({cfg.diloco_inner_steps}): each fragment has its own step of the round")
    if cfg.diloco_overlap_steps >= cfg.diloco_inner_steps:
        raise UserError(f"--diloco-overlap-steps ({cfg.diloco_overlap_steps}) must be below --diloco-inner-steps "
                        f"({cfg.diloco_inner_steps}): an exchange lands before its fragment's next one leaves")
    if cfg.diloco_replicas and cfg.precision != "fp32":
        raise UserError(f"--diloco-replicas with --precision {cfg.precision} is not built yet: the outer "
                        f"step would move the fp32 master weights; use --precision fp32")


def check_replicas(replicas: int, data: int, context: int, expert: int, data_shard: int) -> None:
    """DiLoCo's replicas are blocks of dp / R consecutive dp ranks (diloco/replicas.py),
    each a mesh of its own: hybrid sharding's shard group and an ep group fit inside one."""
    if data % replicas:
        raise UserError(f"--diloco-replicas {replicas} must divide the data-parallel size {data}")
    inner = data // replicas
    if data_shard < data and inner % data_shard:
        raise UserError(f"--data-parallel-shard-size {data_shard} must divide a DiLoCo replica's {inner} dp ranks")
    if (inner * context) % expert:
        raise UserError(f"the expert-parallel size ({expert}) must divide a DiLoCo replica's dp x cp "
                        f"({inner} x {context})")
