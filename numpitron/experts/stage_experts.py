"""The experts of one pipeline stage, as a model is given them (model.py, `experts=`):
which blocks hold a mixture of experts instead of the dense MLP, the layers themselves,
and the routing state every rank keeps beside its parameters.

    log     what the routers did during an iteration's micro-batches (RoutingLog),
            summed over the ranks by the trainer for its metrics and the bias;
    bias    aux-loss-free balancing's per-expert bias (n_layers x E; DeepSeek-V3
            §2.1.2), every block's on every rank, moved by the trainer after each step
            and saved in the checkpoint's manifest.

A model without experts is given none, and no layer of it knows that experts exist.
"""

import numpy as np

from numpitron.experts.moe import MixtureOfExperts, RoutingLog


class StageExperts:
    def __init__(self, model_cfg, topo, a2a_overlap: bool = True):
        """a2a_overlap: the layers' all-to-alls travel while they compute (--moe-a2a-overlap)."""
        self.cfg, self.topo, self.a2a_overlap = model_cfg, topo, a2a_overlap
        self.log = RoutingLog(model_cfg.n_layers, model_cfg.num_experts)
        self.bias = np.zeros((model_cfg.n_layers, model_cfg.num_experts))
        self.layers = []

    def mlp(self, block: int, name: str, out_std: float, region, loss_weight: float):
        """Block `block`'s mixture of experts, or None where its MLP stays dense
        (--moe-every). loss_weight: the schedule's 1/m, which scales the aux loss's
        gradient (the role of Megatron's MoEAuxLossAutoScaler)."""
        c = self.cfg
        if not c.is_moe_block(block):
            return None
        by_bias = c.moe_load_balancing == "bias"
        layer = MixtureOfExperts(name, c.d_model, self.topo, out_std, num_experts=c.num_experts, top_k=c.moe_top_k,
                                 capacity_factor=c.moe_capacity_factor,
                                 aux_loss_coef=0.0 if by_bias else c.moe_aux_loss_coef, loss_weight=loss_weight,
                                 block=block, log=self.log, balance_bias=self.bias[block] if by_bias else None,
                                 shared_experts=c.moe_shared_experts, expert_hidden=c.moe_expert_hidden, region=region,
                                 a2a_overlap=self.a2a_overlap)
        self.layers.append(layer)
        return layer

    def set_loss_weight(self, weight: float) -> None:
        """A ramp-up (--rampup-batch-size) changes m from step to step: every router follows."""
        for layer in self.layers:
            layer.router.loss_weight = weight

    def parameters(self) -> list:
        """The routed experts' parameters: their own flat buffer, averaged over expert_dp."""
        return [p for layer in self.layers for p in layer.experts.parameters()]
