"""What the configurations describe, built: the stage (a `GPTStage` given its experts when
it has them), its optimizers (the one place that picks the implementation for a ZeRO
stage: data_parallel/distributed_optimizer.py is their interface), and the trainer around
them (the number format, FP8, the BLAS, the experts' statistics). Every entry point builds here, so that the model
(model.py) and the step (trainer.py) never need to know the features that wrap them."""

from numpitron.blas.products import use_blas
from numpitron.chunk_pairing.executor import PairedSchedule, pairs_chunks
from numpitron.compression.optimizer import CompressedDataParallelOptimizer, CompressedZeroOneOptimizer
from numpitron.data_parallel.buckets import DataParallelOptimizer, HierarchicalDataParallelOptimizer
from numpitron.data_parallel.distributed_optimizer import GradientGroup
from numpitron.data_parallel.zero import ZeroOneOptimizer, ZeroTwoOptimizer
from numpitron.data_parallel.zero3 import ZeroThreeOptimizer
from numpitron.diloco.feature import DiLoCo
from numpitron.experts.routing_statistics import RoutingStatistics
from numpitron.experts.stage_experts import StageExperts
from numpitron.model import GPTStage
from numpitron.muon.owners import use_muon
from numpitron.optim.sgd import SGD
from numpitron.precision.formats import FORMATS, LossScaler, use_format
from numpitron.precision.fp8 import DelayedScaling, linear_layers
from numpitron.precision.master_weights import optimizer_format
from numpitron.precision.mixed_step import Fp8Scaling, MixedPrecisionStep
from numpitron.trainer import Trainer


def build_stage(model_cfg, topo, moe_a2a_overlap: bool = True, **options) -> GPTStage:
    """This rank's stage; options are GPTStage's (seed, sequence_parallel, recompute, ...);
    moe_a2a_overlap goes to the experts alone (experts/moe.py)."""
    experts = StageExperts(model_cfg, topo, moe_a2a_overlap) if model_cfg.num_experts else None
    return GPTStage(model_cfg, topo, experts=experts, **options)


OPTIMIZERS = {0: DataParallelOptimizer, 1: ZeroOneOptimizer, 2: ZeroTwoOptimizer, 3: ZeroThreeOptimizer}


def make_optimizer(store, topo, train_cfg, parallel_cfg, group: GradientGroup | None = None,
                   zero_stage: int | None = None):
    """Built after the model: an optimizer that shards pads the store itself. With
    --optimizer muon its update rule is Muon's, with --optimizer sgd plain SGD's, whatever
    the ZeRO stage, the precision and the way the gradients are reduced. zero_stage: this store's, if not the run's."""
    chosen = OPTIMIZERS[parallel_cfg.zero_stage if zero_stage is None else zero_stage]
    if parallel_cfg.hierarchical_all_reduce:         # plain dp only (config.py)
        chosen = HierarchicalDataParallelOptimizer
    if parallel_cfg.grad_compression != "none":       # ZeRO-0 or 1, fp32 (compression/checks.py)
        chosen = CompressedZeroOneOptimizer if chosen is ZeroOneOptimizer else CompressedDataParallelOptimizer
    optimizer = chosen(store, topo, train_cfg, parallel_cfg, group, precision=optimizer_format(train_cfg))
    if train_cfg.optimizer == "muon":
        use_muon(optimizer, topo, train_cfg)
    elif train_cfg.optimizer == "sgd":
        optimizer.use_rule(SGD(train_cfg.weight_decay))
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


def build_trainer(model_cfg, parallel_cfg, train_cfg, topo) -> Trainer:
    """Configs as `cli.setup_training` validated them, on any Topology."""
    model = build_stage(model_cfg, topo, seed=train_cfg.seed, sequence_parallel=parallel_cfg.sequence_parallel,
                        recompute=parallel_cfg.recompute, loss_weight=1.0 / train_cfg.num_microbatches(topo.dp),
                        virtual_stages=parallel_cfg.virtual_stages, v_shape=parallel_cfg.v_shaped,
                        tp_comm_overlap=parallel_cfg.tp_comm_overlap, moe_a2a_overlap=parallel_cfg.moe_a2a_overlap)
    optimizers = make_optimizers(model, topo, train_cfg, parallel_cfg)
    optimizers[0].install(model)            # ZeRO-3 gathers each layer while it runs
    # Mixed precision (docs/07-numbers.md): activations rounded between layers,
    # gradients rounded, unscaled and checked by `step_mixed`.
    fmt = FORMATS[train_cfg.precision]
    use_format(model, fmt)
    scaler = LossScaler(fmt, train_cfg.loss_scale, train_cfg.loss_scale_window)     # inert (1) in fp32
    step_rule = MixedPrecisionStep(scaler) if fmt.mixed else None
    features = [RoutingStatistics(model.experts)] if model.experts else []
    fp8 = None
    if fmt.fp8_matmuls:         # the linear layers' products take per-tensor scales from amax histories
        fp8 = DelayedScaling(list(linear_layers(model)), topo.world)
        fp8.install(linear_layers(model))
        features.insert(0, Fp8Scaling(fp8))
    blas = use_blas(model, parallel_cfg.resolved_blas())      # --blas: the products' library (blas/)
    readers = None                  # the dp ranks read the global batch, unless DiLoCo's replicas share it
    if train_cfg.diloco_replicas:   # diloco/: an outer step after every H-th, over the replicas
        diloco = DiLoCo(topo, optimizers, train_cfg)
        features.append(diloco)
        readers = diloco.readers(topo)
    trainer = Trainer(model_cfg, parallel_cfg, train_cfg, topo, model, optimizers, step_rule, features, readers)
    trainer.fp8, trainer.scaler, trainer.blas = fp8, scaler, blas
    if pairs_chunks(model_cfg, parallel_cfg):     # a forward and a backward chunk hide each other's all-to-alls
        trainer.run_schedule = PairedSchedule(model)
    return trainer
