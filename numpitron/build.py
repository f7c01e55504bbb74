"""The model a configuration describes: a `GPTStage` given its experts (experts/) when the
configuration has them. Every entry point builds its model here, so that the model itself
(model.py) never needs to know the features that wrap it."""

from numpitron.experts.stage_experts import StageExperts
from numpitron.model import GPTStage


def build_stage(model_cfg, topo, **options) -> GPTStage:
    """This rank's stage; options are GPTStage's (seed, sequence_parallel, recompute, ...)."""
    experts = StageExperts(model_cfg, topo) if model_cfg.num_experts else None
    return GPTStage(model_cfg, topo, experts=experts, **options)
