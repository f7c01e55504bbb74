"""DiLoCo's settings, a mixin of TrainConfig (config.py): each field is a flag and a key
of a --config file's [training] table (config_fields.py), declared here beside the
feature rather than in the core's config. Checked by `check_diloco` (checks.py)."""

from dataclasses import dataclass

from numpitron.config_fields import setting
from numpitron.diloco.checks import OUTER_DTYPES


@dataclass(frozen=True)
class DilocoSettings:
    # DiLoCo (diloco/, docs/18-across-slow-links.md); 0 replicas: off.
    diloco_replicas: int = setting(0, "DiLoCo: the dp ranks split into R replicas (R divides dp) that exchange "
                                      "nothing for --diloco-inner-steps steps, then average how far they moved "
                                      "(0: off)")
    diloco_inner_steps: int = setting(100, "DiLoCo: inner steps per round (H)")
    diloco_outer_lr: float = setting(0.7, "DiLoCo: the outer step's learning rate")
    diloco_outer_momentum: float = setting(0.9, "DiLoCo: the outer step's Nesterov momentum")
    # Streaming DiLoCo (Douillard et al. 2025): diloco/streaming.py.
    diloco_fragments: int = setting(1, "streaming DiLoCo: the stage's parameters cut into F fragments whose outer "
                                       "steps are staggered over the H inner steps")
    diloco_overlap_steps: int = setting(0, "streaming DiLoCo: a fragment's exchange runs during the next tau inner "
                                           "steps and lands after them (tau < H)")
    diloco_merge_alpha: float = setting(0.5, "streaming DiLoCo, tau > 0: a landed fragment becomes alpha x its local "
                                             "value + (1 - alpha) x the outer step's")
    diloco_outer_dtype: str = setting("fp32", "DiLoCo: the pseudo-gradients travel in fp32, bf16, int8 or int4 "
                                              "(a scale per chunk)", choices=OUTER_DTYPES)
