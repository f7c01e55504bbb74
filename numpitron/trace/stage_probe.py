"""The computation of a traced step, as spans on the computation track: each pipeline
operation (F, BW, B, W of one micro-batch and chunk, what the executor runs), each
top-level layer's pass inside it, the gradients' finalisation and the optimizer step.
Instance-level wrappers on the built stage, its layers and the trainer's step rule,
and one `StepFeature` that marks the step's phases; the classes stay as they are."""

from numpitron.pipeline_parallel.schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, make_schedule
from numpitron.trace.recorder import COMPUTE, Patches, compute_track, now
from numpitron.trainer import StepFeature

# The stage's methods, and the executor's name for the operation each one runs.
STAGE_PASSES = {"forward": FORWARD, "backward": BACKWARD, "backward_input": INPUT_GRAD,
                "backward_weights": WEIGHT_GRAD}
LAYER_NAMES = {"Embeddings": "embeddings", "LanguageModelHead": "head"}


def layer_label(layer) -> str:
    """A top-level layer's name: embeddings, head, or its block's ("blocks.3")."""
    if type(layer).__name__ in LAYER_NAMES:
        return LAYER_NAMES[type(layer).__name__]
    params = layer.parameters()
    return ".".join(params[0].name.split(".")[:2]) if params else type(layer).__name__


class StageProbe(StepFeature):
    """Installed on a trainer by `install`; also the feature that opens each step."""

    def __init__(self, recorder, trainer):
        self.rec, self.trainer = recorder, trainer
        self.current = None            # (op, micro-batch, chunk) of the operation running
        self.order, self.seen = {}, {}
        self.step_start = None
        self.patches = Patches()

    def install(self) -> None:
        model, trainer, wrap = self.trainer.model, self.trainer, self.patches.wrap
        for method, op in STAGE_PASSES.items():
            wrap(model, method, lambda call, op=op: self._operation(op, call))
        wrap(model, "finalize_grads", lambda call: self._span("finalize grads", call))
        for layer in model.layers:
            label = layer_label(layer)
            for method, op in STAGE_PASSES.items():
                wrap(layer, method, lambda call, name=f"{label} {op}": self._layer(name, call))
        wrap(trainer.step_rule, "step", lambda call: self._span("optimizer step", call))
        trainer.features.append(self)

    def uninstall(self) -> None:
        self.patches.undo()
        self.trainer.features.remove(self)

    # The feature: the step's phases, and which micro-batch each operation is.
    def begin_step(self, trainer) -> None:
        self.step_start, self.order, self.seen = now(), {}, {}

    def end_backward(self, trainer) -> None:
        if self.rec.active and self.step_start is not None:
            self.rec.add("forward and backward", "step", COMPUTE, self.step_start, now())

    def _microbatch(self, op: str, chunk: int):
        """The executor walks the schedule's list in order: the k-th `op` of `chunk` in
        this step is the k-th such entry of the list (evaluation: none)."""
        if self.rec.phase != "train":
            return None
        if not self.order:
            t, topo = self.trainer, self.trainer.topo
            for entry in make_schedule(t.parallel_cfg.schedule, t.num_microbatches, topo.pp, topo.pp_rank,
                                       t.model.virtual_stages):
                self.order.setdefault((entry.action, entry.chunk), []).append(entry.microbatch)
        k = self.seen[(op, chunk)] = self.seen.get((op, chunk), -1) + 1
        found = self.order.get((op, chunk), [])
        return found[k] if k < len(found) else None

    def _operation(self, op: str, call):
        rec = self.rec

        def traced(*args, chunk: int = 0, **kwargs):
            if not rec.active:
                return call(*args, chunk=chunk, **kwargs)
            start = now()              # the executor's clock starts here too: the look-up is inside
            mb = self._microbatch(op, chunk)
            self.current = {"microbatch": mb, "chunk": chunk}
            try:
                return call(*args, chunk=chunk, **kwargs)
            finally:
                name = op if mb is None else f"{op} {mb}"
                rec.add(name if rec.phase == "train" else f"{op} (eval)", "compute", compute_track(), start, now(),
                        {"op": op, **self.current, "virtual_stage": self.trainer.model.placement.stage(
                            self.trainer.topo.pp_rank, chunk)})
        return traced

    def _layer(self, name: str, call):
        return self._timed(name, "layer", call, lambda: self.current)

    def _span(self, name: str, call):
        return self._timed(name, "compute" if name != "optimizer step" else "optimizer", call, lambda: None)

    def _timed(self, name: str, category: str, call, args):
        """`call`, recorded as one span on the compute track while the recorder is active."""
        rec = self.rec

        def traced(*a, **kwargs):
            if not rec.active:
                return call(*a, **kwargs)
            start = now()
            try:
                return call(*a, **kwargs)
            finally:
                rec.add(name, category, compute_track(), start, now(), args())
        return traced
