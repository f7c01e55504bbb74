"""What the configurations describe, built: the stage (a `GPTStage` given its experts when
it has them) and the trainer around it (the optimizers for the ZeRO stage, the number
format, FP8, the experts' statistics). Every entry point builds here, so that the model
(model.py) and the step (trainer.py) never need to know the features that wrap them."""

from numpitron.experts.routing_statistics import RoutingStatistics
from numpitron.experts.stage_experts import StageExperts
from numpitron.model import GPTStage
from numpitron.optim.factory import make_optimizers
from numpitron.precision.formats import FORMATS, LossScaler, use_format
from numpitron.precision.fp8 import DelayedScaling, linear_layers
from numpitron.precision.mixed_step import Fp8Scaling, MixedPrecisionStep
from numpitron.trainer import Trainer


def build_stage(model_cfg, topo, **options) -> GPTStage:
    """This rank's stage; options are GPTStage's (seed, sequence_parallel, recompute, ...)."""
    experts = StageExperts(model_cfg, topo) if model_cfg.num_experts else None
    return GPTStage(model_cfg, topo, experts=experts, **options)


def build_trainer(model_cfg, parallel_cfg, train_cfg, topo) -> Trainer:
    """Configs as `cli.setup_training` validated them, on any Topology."""
    model = build_stage(model_cfg, topo, seed=train_cfg.seed, sequence_parallel=parallel_cfg.sequence_parallel,
                        recompute=parallel_cfg.recompute, loss_weight=1.0 / train_cfg.num_microbatches(topo.dp),
                        virtual_stages=parallel_cfg.virtual_stages, v_shape=parallel_cfg.v_shaped,
                        tp_comm_overlap=parallel_cfg.tp_comm_overlap)
    optimizers = make_optimizers(model, topo, train_cfg, parallel_cfg)
    optimizers[0].install(model)            # ZeRO-3 gathers each layer while it runs
    # Mixed precision (docs/16-numbers.md): activations rounded between layers,
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
    trainer = Trainer(model_cfg, parallel_cfg, train_cfg, topo, model, optimizers, step_rule, features)
    trainer.fp8, trainer.scaler = fp8, scaler
    return trainer
