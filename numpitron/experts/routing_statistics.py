"""What the experts add to every training step, as a feature around it (trainer.py's
`StepFeature`): the routing log cleared before the micro-batches, then summed over the
ranks into the step's metrics, the aux loss added to the reported loss, and aux-loss-free
balancing's bias moved from this step's global load (DeepSeek-V3 §2.1.2)."""

from numpitron.experts.router import update_balance_bias
from numpitron.trainer import StepFeature


class RoutingStatistics(StepFeature):
    def __init__(self, experts):
        self.experts = experts          # the stage's (experts/stage_experts.py)

    def begin_step(self, trainer) -> None:
        self.experts.log.reset()

    def end_step(self, trainer, out: dict) -> None:
        out.update(self.metrics(trainer))
        out["train_loss"] += out["moe_aux_loss"]
        c = trainer.model_cfg
        if c.moe_load_balancing == "bias":      # from this step's global load
            update_balance_bias(self.experts.bias, self.experts.log.tokens, c.moe_bias_update_rate)

    def metrics(self, trainer) -> dict:
        """The iteration's routing, summed over every rank's micro-batches (each stage
        knows its own blocks): the aux loss as it enters the objective (mean over
        micro-batches, summed over blocks), the dropped share of assignments, the
        assignments each expert of each MoE block was chosen for, and each block's
        balance: its busiest expert's load over the mean load. After the reduction the
        counts are the global ones on every rank: each stage's blocks summed over pp,
        every rank that routes over dp and cp (ep lies inside dp; tp ranks route alike)."""
        log, topo, c = self.experts.log, trainer.topo, trainer.model_cfg
        buf = log.vector()
        topo.dp_cp_comm.all_reduce(buf)
        topo.pp_comm.all_reduce(buf)
        log.from_vector(buf)
        moe_blocks = [i for i in range(c.n_layers) if c.is_moe_block(i)]
        load = log.tokens[moe_blocks]
        assigned = load.sum()
        return {"moe_aux_loss": float(log.aux_loss.sum()) / (trainer.num_microbatches * topo.dp_cp),
                "moe_dropped_fraction": float(log.dropped.sum() / assigned),
                "moe_tokens_per_expert": load.astype(int).tolist(),
                "moe_max_over_mean_load": (load.max(axis=1) / load.mean(axis=1)).tolist()}
