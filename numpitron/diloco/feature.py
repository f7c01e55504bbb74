"""DiLoCo around the training step (trainer.py's `StepFeature`): nothing changes inside
a replica's step; after every H-th step the replicas take the outer step together
(diloco/outer.py; fragment by fragment, staggered and overlapped, with streaming
DiLoCo: diloco/streaming.py), and the step's loss and an evaluation's are averaged
over them.

Each replica reads its own rows of every global batch (`readers`): the R replicas'
dp/R ranks are R x dp/R = dp readers, so a step sees the global batch's tokens, the
same ones plain data parallelism sees, whatever R. `diloco_bytes` in a step's metrics
is what this rank sent to the other replicas in that step: nothing for H - 1 steps,
then 2 (R-1)/R of its slice (an all-reduce; with F fragments, 2 (R-1)/R of a fragment
when one leaves, in the format of diloco/exchange.py); `diloco_metrics` counts the few
bytes of the averaged loss apart.
"""

import numpy as np

from numpitron.distributed.comm import Comm
from numpitron.diloco.outer import RoundState, held_slice
from numpitron.diloco.replicas import replicas_of
from numpitron.diloco.streaming import Streaming
from numpitron.trainer import Readers, StepFeature


class DiLoCo(StepFeature):
    def __init__(self, topo, optimizers, train_cfg):
        self.replicas = replicas_of(topo)
        overlap = train_cfg.diloco_overlap_steps > 0
        for optimizer in optimizers:       # θ_start: the parameters every replica starts from
            optimizer.use_rule(RoundState(optimizer.adam, held_slice(optimizer), overlap))
        across = self.replicas.comm
        self.streaming = Streaming(optimizers, across, train_cfg)
        self.metrics_comm = Comm(across.mpi, topo.stats, "diloco_metrics", across.watchdog)
        self.stats = topo.stats

    def readers(self, topo) -> Readers:
        """Replica k's dp rank d is reader k dp/R + d of the R dp/R that split a batch."""
        return Readers(self.replicas.count * topo.dp, self.replicas.index * topo.dp + topo.dp_rank)

    def end_step(self, trainer, out: dict) -> None:
        self.streaming.end_step(trainer.iteration)      # the fragments due leave; those due land
        out["train_loss"] = self.mean(out["train_loss"])
        out["diloco_bytes"] = sum(n for name, n in self.stats.bytes.items() if name.startswith("diloco."))

    def end_evaluate(self, trainer, out: dict) -> None:
        """Each replica measured its own rows of the evaluation's batches: their mean is
        the whole batches' loss (at a round's end, of the one shared θ)."""
        for split in out:
            out[split] = self.mean(out[split])

    def mean(self, value: float) -> float:
        buf = np.array([value])
        self.metrics_comm.all_reduce(buf)
        return float(buf[0] / self.metrics_comm.size)
