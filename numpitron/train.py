"""The training loop: steps, periodic evaluation, metrics, checkpoints, resume.

Every rank runs this same loop; only the logging rank (world rank 0) prints and
writes metrics, and checkpoints are gathered to it (see numpitron.checkpoint).
"""

import math
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np

from numpitron.checkpoint import latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint
from numpitron.checkpoint.manifest import iter_dirs
from numpitron.checkpoint.prune import written_by_us
from numpitron.config_file import write_run_config
from numpitron.data.prepare import ensure_prepared
from numpitron.diloco.replicas import replicas_of
from numpitron.data.prepared import load_prepared
from numpitron.divergence import SkippedSteps, check_diverged
from numpitron.optim.memory_report import memory_bytes
from numpitron.distributed.agree import on_every_rank
from numpitron.errors import UserError
from numpitron.memory import check_fits
from numpitron.metrics import MetricsLog
from numpitron.pipeline_parallel.schedules import closed_form_bubble
from numpitron.rampup import Ramp
from numpitron.rundir import METRICS_NAME, claim_on_every_rank
from numpitron.build import build_trainer
from numpitron.trainer import PlainStep

# A run that overflows is caught below and told in one line ("training diverged"): NumPy's
# own RuntimeWarnings about the same overflow, one per kernel, would only come before it.
QUIET = dict(over="ignore", invalid="ignore", divide="ignore")


def prepare_data_on_ranks(topo, data_dir: Path, input_path=None) -> dict:
    """Rank 0 prepares the data (download or copy); the others wait, then use it.
    A rank on a host without the shared directory prepares its own copy."""
    if topo.job.rank == 0:
        ensure_prepared(data_dir, input_path, quiet=False)
    topo.job.barrier()
    return ensure_prepared(data_dir, input_path, quiet=True)


def train(model_cfg, parallel_cfg, train_cfg, topo, data_dir, out_dir, resume=False,
          progress=True, input_path=None, overwrite=False, run_config: str | None = None, reseed=False,
          trace=None) -> dict:
    """run_config: the resolved flags as TOML, written to OUT_DIR/config.toml once the
    directory is claimed and any checkpoint resumed. reseed: resume with another seed. The
    progress is a bar on a terminal, else a line per log interval. trace: a `TraceRequest`
    (trace/tracer.py) to install on the built trainer, or None: nothing is traced."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    paths = prepare_data_on_ranks(topo, data_dir, input_path)
    tokenizer, splits = on_every_rank(topo.world, lambda: load_prepared(paths, model_cfg.seq_len))
    model_cfg = replace(model_cfg, vocab_size=tokenizer.vocab_size).validate()
    replicas = replicas_of(topo)        # DiLoCo's (diloco/): one, the run itself, without it
    check_eval_iters(train_cfg, train_cfg.global_batch(topo.dp * replicas.count), model_cfg.seq_len, splits)
    on_every_rank(topo.world, lambda: check_fits(model_cfg, parallel_cfg, train_cfg, topo))
    lock = claim_on_every_rank(topo, out_dir, resume, overwrite)         # held until the run ends
    trainer = build_trainer(model_cfg, parallel_cfg, train_cfg, topo)
    ckpt_root = out_dir / "checkpoints"
    if topo.replicas is not None:       # each replica its own checkpoints: its inner state is its own
        ckpt_root = ckpt_root / f"replica-{replicas.index}"
    best_ckpt = None
    if resume:
        if not resume_from_latest(ckpt_root, trainer, train_cfg, tokenizer, reseed):
            if lock is not None:
                lock.release()
            return {"iterations": trainer.iteration, "trained": 0, "trainer": trainer}
        best_ckpt = best_checkpoint(ckpt_root)
    # Only a run that will train leaves its configuration: a refused resume changes no file.
    if run_config is not None and topo.is_logger:
        note = write_run_config(out_dir, run_config)
        if note:
            print(note, flush=True)

    def save(reason: str, protect):
        extra = {"saved_for": reason, "tokenizer": tokenizer.to_dict()}
        return save_checkpoint(ckpt_root, trainer, train_cfg.keep_checkpoints, protect=protect, extra=extra)
    log = MetricsLog(out_dir / METRICS_NAME, topo.is_logger, trainer.iteration if resume else None, {"blas": trainer.blas})
    if topo.is_logger:
        print(topo, flush=True)
        if topo.replicas is not None:
            print(f"DiLoCo: {replicas.count} replicas of this mesh, an outer step every "
                  f"{train_cfg.diloco_inner_steps} steps", flush=True)
        print(f"model: {sum(int(math.prod(p.logical_shape)) for p in trainer.model.parameters())} parameters on stage 0; "
              f"{trainer.num_microbatches} micro-batches of {train_cfg.micro_batch_size} per dp rank", flush=True)
    first_iteration = trainer.iteration
    skips = None if isinstance(trainer.step_rule, PlainStep) else SkippedSteps(trainer.scaler)
    tracer = trace.install(trainer) if trace else None
    bar = _progress_bar(trainer.iteration, train_cfg.max_iters, progress and topo.is_logger and sys.stdout.isatty())
    plain = progress and bar is None
    start, last_eval = time.perf_counter(), {}
    while trainer.iteration < train_cfg.max_iters:
        if tracer:
            tracer.begin_iteration(trainer.iteration + 1)
        topo.stats.reset()
        with _traced(tracer, "step"):
            t0 = time.perf_counter()
            scale = trainer.step_rule.loss_scale             # this step's, before the scaler changes it
            with np.errstate(**QUIET):
                step = trainer.train_step(splits["train"])
            dt = time.perf_counter() - t0
        it = trainer.iteration          # iterations completed
        record = {"iter": it, **step, "global_batch_size": trainer.global_batch_size,
                  "tokens_per_s": trainer.global_batch_size * model_cfg.seq_len / dt,
                  "elapsed_s": time.perf_counter() - start,
                  "comm_bytes": topo.stats.total_bytes(),
                  # this rank's parameters, gradients, optimizer state and in-pass peaks (docs/09-zero-2-and-3.md)
                  **{f"memory_{k}": v for k, v in memory_bytes(trainer.optimizer).items()}}
        if topo.pp > 1:
            record["bubble"] = trainer.last_pipeline_stats.bubble_fraction
            record["bubble_formula"] = closed_form_bubble(trainer.parallel_cfg.schedule, topo.pp,
                                                          trainer.num_microbatches, trainer.parallel_cfg.virtual_stages)
            record["peak_in_flight"] = trainer.last_pipeline_stats.peak_in_flight
            record["peak_activation_bytes"] = trainer.last_pipeline_stats.peak_activation_bytes
        check_diverged(it, step, skips is None)
        if skips is not None:
            skips.record(it, step, scale, last=it == train_cfg.max_iters)
        is_eval = it % train_cfg.eval_interval == 0 or it == train_cfg.max_iters
        improved = False
        if is_eval:
            with _traced(tracer, "evaluation"), np.errstate(**QUIET):
                last_eval = trainer.evaluate(splits, train_cfg.eval_iters)
            check_diverged(it, {"validation loss": last_eval["val"]})
            record.update(val_loss=last_eval["val"], eval_train_loss=last_eval["train"])
            improved = last_eval["val"] < trainer.best_val_loss
            trainer.best_val_loss = min(trainer.best_val_loss, last_eval["val"])
        if is_eval or it % train_cfg.log_interval == 0 or it == train_cfg.max_iters:
            log.write(record)            # before the save: a kill during it keeps this row
            _report(bar, record, topo.is_logger, f"/{train_cfg.max_iters}" if plain else None)
        reason = checkpoint_reason(it, improved, train_cfg)
        if reason:
            with _traced(tracer, "checkpoint save"):
                path = save(reason, protect=best_ckpt)
            best_ckpt = path if reason == "best" else best_ckpt
        if tracer:
            tracer.end_iteration()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if tracer:
        tracer.finish()
    if lock is not None:
        lock.release()
    return {"iterations": trainer.iteration, "trained": trainer.iteration - first_iteration,
            "val_loss": last_eval.get("val"),
            "train_loss": last_eval.get("train"), "elapsed_s": time.perf_counter() - start, "trainer": trainer}


def _traced(tracer, name: str):
    """A span of the trace around a part of the loop, or nothing when untraced."""
    return tracer.span(name) if tracer else nullcontext()


def resume_from_latest(ckpt_root: Path, trainer, train_cfg, tokenizer, reseed: bool = False) -> bool:
    """Load the newest checkpoint into `trainer`; False (with a line from the logging
    rank) when it is already at --max-iters. Says so when the global batch changed, and
    refuses a checkpoint trained with another tokenizer than the data's, or (unless
    reseed) with another seed: the seed draws every batch, so the run would go on with
    other data than the checkpoint's run."""
    found = latest_checkpoint(ckpt_root)
    if found is None:
        raise UserError(f"--resume: no checkpoint in {ckpt_root}")
    manifest = load_checkpoint(found, trainer)
    replicas = replicas_of(trainer.topo)
    newest, oldest = replicas.job.all_reduce_object_max(trainer.iteration), -replicas.job.all_reduce_object_max(
        -trainer.iteration)
    if newest != oldest:
        raise UserError(f"--resume: the DiLoCo replicas' latest checkpoints are at different iterations "
                        f"(a kill between their saves): remove the newer ones in {ckpt_root.parent}")
    saved_tokenizer = manifest.get("tokenizer")
    if saved_tokenizer is not None and saved_tokenizer != tokenizer.to_dict():
        raise UserError(f"--resume: {found} was trained with another tokenizer than the data's "
                        f"(e.g. imported from another corpus); its token ids would mean other characters")
    saved_seed = (manifest.get("train_config") or {}).get("seed")
    if isinstance(saved_seed, int) and saved_seed != train_cfg.seed and not reseed:
        raise UserError(f"--resume: {found} was trained with --seed {saved_seed}, and --seed {train_cfg.seed} would "
                        f"draw other batches from here on: pass --seed {saved_seed}, or --reseed to change them")
    if trainer.iteration > train_cfg.max_iters:
        raise UserError(f"--resume: {found} is at iteration {trainer.iteration}, past --max-iters "
                        f"{train_cfg.max_iters}: raise --max-iters to train further")
    note = (f"nothing to train: {found} is at iteration {trainer.iteration} = --max-iters"
            if trainer.iteration == train_cfg.max_iters else batch_change_note(manifest, trainer))
    if note and trainer.topo.is_logger:
        print(note, flush=True)
    return trainer.iteration < train_cfg.max_iters


def check_eval_iters(train_cfg, global_batch: int, seq_len: int, splits: dict) -> None:
    """An evaluation draws eval_iters global batches of random windows from each split:
    more than the smaller split holds distinct windows measures nothing better, and a
    huge count would run for days without a word."""
    windows = min(len(tokens) for tokens in splits.values()) - seq_len
    if train_cfg.eval_iters * global_batch > windows:
        raise UserError(f"--eval-iters {train_cfg.eval_iters} draws {train_cfg.eval_iters * global_batch:,} sequences "
                        f"from each split, more than the {windows:,} distinct ones the smaller split holds: use at "
                        f"most {windows // global_batch}")


def batch_change_note(manifest: dict, trainer) -> str | None:
    """A line if the global batches from the resumed iteration on differ from those the
    checkpoint's run would have taken: another global batch (a default one follows dp, so
    another mesh changes it), or a batch-size ramp added, dropped or changed before it
    was done."""
    saved = saved_batch_schedule(manifest)
    if saved is None:
        return None
    target, ramp = saved
    it, cfg, dp = trainer.iteration, trainer.train_cfg, trainer.topo.dp
    then = Ramp(*ramp, target).at(it) if ramp else target        # the batch the saved run takes next
    now, now_target = cfg.global_batch_at(it, dp), cfg.global_batch(dp)
    ramp_left = then != target                                    # the saved run was still ramping up
    if now_target == target and (tuple(cfg.rampup_batch_size) == ramp if ramp_left else now == target):
        return None
    flags = f"--global-batch-size {target}" + (" --rampup-batch-size {} {} {}".format(*ramp) if ramp_left else
                                               " without --rampup-batch-size" if now != now_target else "")
    saved_run = f"the checkpoint's run would take {then}" if ramp_left else f"the checkpoint trained with {then}"
    head = (f"the global batch is now {now} sequences, {saved_run}" if now != then else
            "from here the global batch ramps up otherwise than in the checkpoint's run")
    return f"note: {head}: pass {flags} to continue its trajectory"


def saved_batch_schedule(manifest: dict) -> tuple[int, tuple] | None:
    """(global batch, ramp) a checkpoint's run trained with, or None if it does not say
    (an import) or says something no run could have used."""
    saved_train, saved_mesh = manifest.get("train_config") or {}, manifest.get("mesh") or {}
    try:
        target = saved_train.get("global_batch_size") or saved_train.get("micro_batch_size", 0) * saved_mesh.get("data", 0)
        ramp = tuple(saved_train.get("rampup_batch_size") or ())
    except (AttributeError, TypeError):
        return None
    whole = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (target, *ramp))
    if not whole or len(ramp) not in (0, 3) or (ramp and ramp[0] > target):
        return None
    return target, ramp


def checkpoint_reason(iteration: int, improved: bool, train_cfg) -> str | None:
    """Why to save after this iteration, if at all (one checkpoint per iteration)."""
    if improved:
        return "best"
    if iteration == train_cfg.max_iters:
        return "final"
    if train_cfg.save_interval and iteration % train_cfg.save_interval == 0:
        return "interval"
    return None


def best_checkpoint(root: Path):
    """The newest checkpoint saved for an improved val loss (kept through pruning)."""
    best = [p for p in iter_dirs(root) if written_by_us(p) and read_manifest(p).get("saved_for") == "best"]
    return best[-1] if best else None


def _progress_bar(initial: int, total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, dynamic_ncols=True, desc="train")


def _report(bar, record: dict, is_logger: bool, plain_of: str | None = None) -> None:
    """Eval results as a line; the rest on the bar, or (plain_of: not a terminal, e.g. a
    log file or a cluster job) as one line per log interval instead of a redrawn bar."""
    if not is_logger:
        return
    fields = {"loss": f"{record['train_loss']:.4f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if plain_of is not None:
        print(f"iter {record['iter']}{plain_of}: " + ", ".join(f"{k} {v}" for k, v in fields.items()), flush=True)
    if "val_loss" in record:
        fields["val"] = f"{record['val_loss']:.4f}"
        message = (f"iter {record['iter']}: train {record['eval_train_loss']:.4f}, "
                   f"val {record['val_loss']:.4f}")
        (bar.write if bar is not None else print)(message)
    if bar is not None:
        bar.set_postfix(fields, refresh=False)
