"""The one place that picks the optimizer for a ZeRO stage (interface:
numpitron/optim/distributed.py)."""

from numpitron.parallel.data_parallel import DataParallelOptimizer
from numpitron.parallel.zero import ZeroOneOptimizer, ZeroTwoOptimizer
from numpitron.parallel.zero3 import ZeroThreeOptimizer

OPTIMIZERS = {0: DataParallelOptimizer, 1: ZeroOneOptimizer, 2: ZeroTwoOptimizer, 3: ZeroThreeOptimizer}


def make_optimizer(store, topo, train_cfg, parallel_cfg):
    """Built after the model: an optimizer that shards pads the store itself."""
    return OPTIMIZERS[parallel_cfg.zero_stage](store, topo, train_cfg, parallel_cfg)
