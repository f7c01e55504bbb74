"""The one place that picks the optimizer for a ZeRO stage (interface:
numpitron/optim/distributed.py)."""

from numpitron.optim.distributed import GradientGroup
from numpitron.parallel.data_parallel import DataParallelOptimizer, HierarchicalDataParallelOptimizer
from numpitron.parallel.muon_owners import use_muon
from numpitron.parallel.zero import ZeroOneOptimizer, ZeroTwoOptimizer
from numpitron.parallel.zero3 import ZeroThreeOptimizer

OPTIMIZERS = {0: DataParallelOptimizer, 1: ZeroOneOptimizer, 2: ZeroTwoOptimizer, 3: ZeroThreeOptimizer}


def make_optimizer(store, topo, train_cfg, parallel_cfg, group: GradientGroup | None = None):
    """Built after the model: an optimizer that shards pads the store itself. With
    --optimizer muon its update rule is Muon's, whatever the ZeRO stage, the precision
    and the way the gradients are reduced."""
    chosen = OPTIMIZERS[parallel_cfg.zero_stage]
    if parallel_cfg.hierarchical_all_reduce:         # plain dp only (config.py)
        chosen = HierarchicalDataParallelOptimizer
    optimizer = chosen(store, topo, train_cfg, parallel_cfg, group)
    if train_cfg.optimizer == "muon":
        use_muon(optimizer, topo, train_cfg)
    return optimizer


def make_optimizers(model, topo, train_cfg, parallel_cfg) -> list:
    """One optimizer per store of the model (model.stores): the dense parameters,
    averaged over dp x cp, then the experts, if any, averaged over expert_dp; both
    sharded the same way (ZeRO stage) over their own group."""
    groups = [GradientGroup.dense(topo), GradientGroup.experts(topo)]
    return [make_optimizer(store, topo, train_cfg, parallel_cfg, group) for store, group in zip(model.stores, groups)]
