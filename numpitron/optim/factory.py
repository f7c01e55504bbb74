"""The one place that picks the optimizer for a ZeRO stage (interface:
numpitron/data_parallel/distributed_optimizer.py)."""

from numpitron.data_parallel.buckets import DataParallelOptimizer, HierarchicalDataParallelOptimizer
from numpitron.data_parallel.distributed_optimizer import GradientGroup
from numpitron.data_parallel.zero import ZeroOneOptimizer, ZeroTwoOptimizer
from numpitron.data_parallel.zero3 import ZeroThreeOptimizer
from numpitron.muon.owners import use_muon
from numpitron.precision.master_weights import optimizer_format

OPTIMIZERS = {0: DataParallelOptimizer, 1: ZeroOneOptimizer, 2: ZeroTwoOptimizer, 3: ZeroThreeOptimizer}


def make_optimizer(store, topo, train_cfg, parallel_cfg, group: GradientGroup | None = None,
                   zero_stage: int | None = None):
    """Built after the model: an optimizer that shards pads the store itself. With
    --optimizer muon its update rule is Muon's, whatever the ZeRO stage, the precision
    and the way the gradients are reduced. zero_stage: this store's, if not the run's."""
    chosen = OPTIMIZERS[parallel_cfg.zero_stage if zero_stage is None else zero_stage]
    if parallel_cfg.hierarchical_all_reduce:         # plain dp only (config.py)
        chosen = HierarchicalDataParallelOptimizer
    optimizer = chosen(store, topo, train_cfg, parallel_cfg, group, precision=optimizer_format(train_cfg))
    if train_cfg.optimizer == "muon":
        use_muon(optimizer, topo, train_cfg)
    return optimizer


def make_optimizers(model, topo, train_cfg, parallel_cfg) -> list:
    """One optimizer per store of the model (model.stores): the dense parameters,
    averaged over dp x cp, then the experts, if any, averaged over expert_dp; both
    sharded the same way (ZeRO stage) over their own group, except that under ZeRO-3
    the experts stay at stage 2: the layer-by-layer gathering is the dense store's
    (data_parallel/zero3.py), and an ep rank holds only its E/ep experts whole anyway."""
    groups = [GradientGroup.dense(topo), GradientGroup.experts(topo)]
    stages = [parallel_cfg.zero_stage, min(parallel_cfg.zero_stage, 2)]
    return [make_optimizer(store, topo, train_cfg, parallel_cfg, group, stage)
            for store, group, stage in zip(model.stores, groups, stages)]
