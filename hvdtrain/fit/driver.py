"""The fit path's driver: ``model.fit`` over the run engine (``hvdtrain.keras.fit`` calls it).

``model.fit`` runs with ``steps_per_epoch`` fixed (twice when resuming inside an epoch:
once for the rest of that epoch, once for the others) and a callback that hands Keras'
events to ``FitRun``, which asks the engine (``engine.Run``) for everything a run's life needs:
the run directory, rank 0's state broadcast before the first step (initial or restored),
checkpoints with the data position, SIGTERM on any rank stopping every rank after the same
step, divergence, the watchdog, result.json and model.keras. What is the fit path's own:
epoch and validation metrics made exact over all ranks (the metrics' state variables summed
over ranks; the validation set split so each example is scored by one rank). A tf.data
input is ``pipeline.Batches``: the same interface as ``hk.dataset``'s batches. With gradient
accumulation (``hk.DistributedOptimizer(..., backward_passes_per_step=N)``) Keras' steps are
micro-batches and the run's global step counts updates; checkpoints and SIGTERM stops wait
for the first call boundary that ends an update, so no checkpoint holds half an update.
"""

from __future__ import annotations

import time

import numpy as np

from hvdtrain.base import compat, timings
from hvdtrain.base.errors import ConfigError, step_failed
from hvdtrain.distributed.world import Progress, steps_done
from hvdtrain.engine import preflight
from hvdtrain.engine.report import EpochRecord
from hvdtrain.engine.run import Run
from hvdtrain.fit.callback import Calls, keras_callback
from hvdtrain.fit.metrics import GlobalMetrics
from hvdtrain.fit.script import (
    applied_optimizers,
    check_validation,
    steps_per_execution,
    validation_shard,
)
from hvdtrain.fit.steps import STOP_CHECK_EVERY, FitCounters, StopCheck, passed
from hvdtrain.inputs import pipeline

__all__ = ["STOP_CHECK_EVERY", "FitCounters", "FitRun"]


class FitRun:
    """One ``hk.fit`` on this rank, over the engine's ``Run``: the controller the Keras
    callback (``callback.keras_callback``) hands its events to; ``at`` is what it counts."""

    def __init__(self, model, train, validation_data, run: Run, sharded: bool = False):
        self.model, self.train, self.run_, self.world = model, train, run, run.world
        with timings.phase("data"):
            self.validation_data = check_validation(validation_data, train, run.world, sharded)
        self.out = run.out
        self.epochs = run.config.epochs
        # Keras' steps are micro-batches: backward_passes_per_step of them make an update,
        # and the run's global step counts updates (as the Task path's does).
        self.passes = run.config.accumulate_steps
        self.examples_per_step = train.batch_size * self.world.size  # a Keras step's, all ranks
        self.global_batch = self.examples_per_step * self.passes  # an update's, all ranks
        self.at = FitCounters()
        self.metrics = GlobalMetrics(model, self.world)
        if isinstance(train, pipeline.Batches):  # the examples: FitSettings' (train_examples)
            run.use_input(train, {"train_files": train.train_files})
        self.calls = Calls(model)
        self.stops = StopCheck(run)  # SIGTERM on any rank, asked every STOP_CHECK_EVERY steps
        self.saved_sums = None  # a mid-epoch resume's part of the epoch's metric sums
        self.train_logs: dict = {}  # the epoch's training metrics over every rank
        self.val_logs: dict = {}  # its validation metrics over every rank
        self.first_call = 0  # the depth of the open first_call phase (timings), 0: none
        self.evaluating = 0  # the same for evaluation
        self.records: dict = {}  # this process's epochs' records (EpochRecord), by epoch

    # --- before model.fit: build, restore, broadcast ------------------------------------------
    def _prepare(self) -> Progress:
        run = self.run_
        self._build()
        run.claim()
        # Several optimizers (a GAN): the run's step is the first's; every one's variables
        # are in the broadcast and the checkpoints (those that exist before the first step).
        (_, first), *others = applied_optimizers(self.model)
        progress = run.restore(self.model, first, [o for _, o in others])
        run.broadcast()
        self.stops.attach(self.model, first)
        if progress.epoch is None:
            progress.epoch, progress.offset = 0, 0
        return progress

    @timings.timed("model")
    def _build(self) -> None:
        """The model built on the first batch, checked; the optimizer's slots created."""
        model, run = self.model, self.run_
        if model.jit_compile:  # True, or Keras 3's "auto" with a GPU visible
            self.out.notice("hvdtrain: jit_compile turned off: Horovod's ops have no XLA kernels")
            model.jit_compile = False  # the setter drops any traced train function
        if isinstance(self.train, pipeline.Batches):  # the user's examples must fit the model
            run.user(
                f"hk.fit: the model on {self.train.what}'s first batch", model, self.train.sample
            )
        elif not model.built:
            model(self.train.sample)
        compat.check_model(model, "hk.fit", "was given")
        with timings.phase("agreement"):  # the same model on every rank, before any write
            preflight.check_model(self.world, model)
        # Create the optimizer's slots now, so that one broadcast covers the whole state.
        if any(o is model.optimizer for _, o in applied_optimizers(model)):
            model.optimizer.build(model.trainable_variables)

    # --- model.fit ----------------------------------------------------------------------------
    def fit(self, callbacks, validation_batch_size):
        keras, train, run = compat.keras(), self.train, self.run_
        run.check_run_dir()
        if run.finished is not None:
            return self._finished(keras)
        progress, at = self._prepare(), self.at
        start = progress.epoch
        first = steps_done(progress, self.examples_per_step, train.steps)
        self.saved_sums = progress.sums
        at.global_step = run.global_step
        at.micro = at.global_step * self.passes  # micro-batches (Keras' steps) so far
        if progress.path:
            self.out.notice(
                f"hvdtrain: resumed from {progress.path} at epoch {start + 1}, "
                f"step {at.global_step}"
            )
        elif at.global_step:  # e.g. a second hk.fit of the same model in one process
            self.out.notice(
                f"hvdtrain: the model's optimizer is at step {at.global_step} "
                "already; training on from there"
            )
        run.start(progress, self.global_batch)
        with timings.phase("data"):  # this rank's part of the arrays, or the user's pipeline
            val, val_steps, validation_batch_size = validation_shard(
                self.validation_data, self.world, validation_batch_size
            )
        callback = keras_callback(keras, self)
        shown = self.out.verbose if self.out.interactive else 0  # rank 0, on a terminal
        histories = []
        # Resuming inside an epoch: one call for its remaining steps, then the others.
        for e0, e1, skip in (
            ((start, start + 1, first), (start + 1, self.epochs, 0))
            if first
            else ((start, self.epochs, 0),)
        ):
            if e1 <= e0:
                continue
            at.first_step = skip
            with timings.phase("data"):
                batches = self.calls.input(train.batches(e0, e1, skip))
            with timings.phase("training"):
                # Keras' setup and its first compiled call (tracing), until its first batch ends
                self.first_call = timings.enter("first_call") if not histories else 0
                histories.append(
                    self._model_fit(
                        batches,
                        epochs=e1,
                        initial_epoch=e0,
                        steps_per_epoch=train.steps - skip,
                        validation_data=val,
                        validation_batch_size=validation_batch_size,
                        validation_steps=val_steps,
                        callbacks=[callback] + callbacks,
                        shuffle=False,
                        verbose=shown,
                    )
                )  # the order is the Dataset's
        best = self._restored_best(callbacks)
        run.finish(
            {
                "batch_size": train.batch_size,
                "global_batch_size": self.global_batch,
                **best,
                **train.info(),
            },
            self.model,
        )
        self.world.finished_runs.add(run.dir.path)
        history = histories[-1] if histories else keras.callbacks.History()
        for h in histories[:-1]:  # one History for the whole run
            history.epoch = h.epoch + history.epoch
            for k, v in h.history.items():
                history.history[k] = v + history.history.get(k, [])
        return history

    def _model_fit(self, batches, **kwargs):
        """Keras' ``model.fit``; a TensorFlow op error of one rank's step as one line: a
        tf.data input that changed under the run (a file cut short or deleted) naming the
        file, else (a label outside the model's classes, a tf.data map that raised) its cause
        and step (the updates done, as the optimizer counted them, plus one). The watchdog
        takes it to rank 0; Horovod's own errors pass through."""
        import tensorflow as tf

        try:
            return self.model.fit(batches, **kwargs)
        except tf.errors.OpError as e:
            if isinstance(self.train, pipeline.Batches):
                error = self.train.failure(e, self.at.epoch)
                if error is not None:
                    raise error from None
            # The step: after the last call that ended (batch_end counted its steps), within
            # the next call's (Keras' steps are micro-batches when accumulating).
            micro = self.at.micro
            first, last = (
                micro // self.passes + 1,
                (micro + steps_per_execution(self.model) - 1) // self.passes + 1,
            )
            where = (
                f"validation after training step {self.at.global_step}"
                if self.evaluating
                else f"training step {first}"
                if first == last
                else f"one of training steps {first}-{last}"
            )
            raise step_failed(e, where, self.world.rank) or e

    def _restored_best(self, callbacks) -> dict:
        """EarlyStopping(restore_best_weights=True) put its best epoch's weights back at the
        end: result.json's final_* are then that epoch's (``restored_best_epoch``), and a
        checkpoint holds them (a rerun restores what model.keras holds). Every rank decides
        the same: the callback saw the same global metrics on each."""
        keras = compat.keras()
        for cb in callbacks:
            best = getattr(cb, "best_weights", None)
            if not (
                isinstance(cb, keras.callbacks.EarlyStopping)
                and best is not None
                and getattr(cb, "restore_best_weights", False)
            ):
                continue
            epoch = int(getattr(cb, "best_epoch", -1))
            record = self.records.get(epoch + 1)
            now = self.model.get_weights()
            if (
                record is None
                or record is self.run_.last_record
                or len(now) != len(best)
                or not all(np.array_equal(a, b) for a, b in zip(now, best))
            ):
                continue  # not restored, or the last epoch was the best
            self.run_.use_record(record)
            self.run_.save(
                Progress(epoch=self.at.epochs_done, offset=0), np.zeros_like(self.metrics.flat())
            )
            return {"restored_best_epoch": epoch + 1}
        return {}

    def _finished(self, keras):
        """``run_dir`` holds a finished run. Run again as the same command (a new process):
        nothing trains, nothing is overwritten, and the model gets the run's final state
        from its newest checkpoint, so that the script's next lines (evaluate, a second
        phase) see the trained model; the History is the run's, from metrics.jsonl. Given to
        a second hk.fit of this process (a second phase of training): refused, each phase
        needs its own run_dir."""
        run = self.run_
        if run.dir.path in self.world.finished_runs:
            raise ConfigError(
                "run_dir",
                run.dir.path,
                "holds this script's earlier hk.fit, "
                "finished: give each phase of training its own run_dir (e.g. "
                "run_dir=RUN_DIR + '/phase2'), or more epochs to train on in it",
            )
        self._prepare()  # the newest checkpoint restored on rank 0 and broadcast
        self.out.notice(run.unchanged())
        history = keras.callbacks.History()
        records = run.world.broadcast_object(self.out.records() if self.world.is_chief else None)
        history.epoch = [r["epoch"] - 1 for r in records]
        for r in records:
            for k, v in EpochRecord.from_dict(r).metrics.items():
                history.history.setdefault(k, []).append(v)
        return history

    # --- the callback's work --------------------------------------------------------------------
    def epoch_begin(self, epoch):
        if isinstance(self.train, pipeline.Batches):  # all ranks: no input changed since
            self.train.check_unchanged(f"before epoch {epoch + 1}")
        at = self.at
        at.epoch, at.step, at.started = epoch, at.first_step, at.first_step
        at.first_step, at.tick = 0, time.perf_counter()
        self.out.epoch_began()

    def batch_begin(self):
        self.calls.begin(self.train.steps - self.at.step)
        self.stops.raise_local()

    def batch_end(self, batch, logs):
        world, run, at = self.world, self.run_, self.at
        timings.leave(self.first_call)  # the first call is over (a no-op after it)
        self.first_call = 0
        self.calls.end()
        if self.saved_sums is not None:  # first step after a mid-epoch resume: the saved part
            if world.is_chief:  # of the epoch's metric sums (already over all ranks)
                self.metrics.add(self.saved_sums)
            self.saved_sums = None
        # With steps_per_execution N, Keras calls this once per N steps with the index (in
        # this model.fit's epoch) of the call's last step; Keras 3 says N - 1 more even for
        # a shorter last call of the epoch, hence the bound.
        step = min(at.started + batch + 1, self.train.steps)
        done, at.step = step - at.step, step
        at.micro += done
        updated, at.global_step = at.global_step, at.micro // self.passes
        run.reached(at.global_step)
        last = at.step == self.train.steps
        if not last and self.stops.any(at.step, done):
            at.stop_pending = True
        # At the first call boundary at or after each multiple of checkpoint_every updates
        # (the multiple itself when steps_per_execution is 1 or divides it).
        if passed(at.global_step, at.global_step - updated, run.config.checkpoint_every):
            at.save_pending = True
        if last:  # before validation resets the metrics
            self.train_logs, stop = self.metrics.reduce(stop=run.stop_requested)
            at.stop_pending = at.stop_pending or stop
            if logs is not None:
                logs.update(self.train_logs)
            return  # the epoch's end saves, and stops if a stop is pending
        if self.out.progress_due(drawn=self.out.interactive):  # Keras' bar draws it there
            self.out.progress(
                at.epoch + 1,
                self.epochs,
                at.step,
                self.train.steps,
                at.step - at.started,
                self.examples_per_step,
                {k: float(v) for k, v in (logs or {}).items() if np.ndim(v) == 0},
            )
        if at.micro % self.passes:
            return  # inside an update: its gradients are half accumulated, not in a checkpoint
        if at.stop_pending:
            run.save(self._position(), self.metrics.summed())
            run.preempt(at.global_step)
        elif at.save_pending:
            # The state between updates.
            at.save_pending = False
            run.save(self._position(), self.metrics.summed())

    def test_begin(self):
        self.evaluating = timings.enter("evaluation")
        self.run_.sync_state()  # every rank scores its part with the same statistics

    def test_end(self, logs):
        self.val_logs, _ = self.metrics.reduce()
        if logs is not None:
            logs.update(self.val_logs)
        timings.leave(self.evaluating)
        self.evaluating = 0

    def epoch_end(self, epoch, logs):
        run, at = self.run_, self.at
        logs.update(self.train_logs)  # Keras 2 built its dict before the reduction
        if self.validation_data is not None:
            logs.update({f"val_{k}": v for k, v in self.val_logs.items()})
        seconds = time.perf_counter() - at.tick
        record = EpochRecord(
            epoch=epoch + 1,
            epochs=self.epochs,
            global_step=at.global_step,
            metrics={k: float(v) for k, v in logs.items() if np.ndim(v) == 0},
            samples_per_sec=(self.train.steps - at.started) * self.examples_per_step / seconds,
            seconds=seconds,
            world_size=self.world.size,
        )
        if run.config.stop_on_divergence and not np.isfinite(record.metrics.get("loss", 0.0)):
            # The loss is reduced over every rank: every rank decides the same here.
            raise run.diverged(f"the loss became NaN or infinite in epoch {epoch + 1}")
        run.epoch_end(record)
        self.records[epoch + 1], at.epochs_done = record, epoch + 1
        run.save(Progress(epoch=epoch + 1, offset=0), np.zeros_like(self.metrics.flat()))
        at.save_pending = False
        if not self.out.interactive:
            self.out.print(
                f"Epoch {epoch + 1}/{self.epochs} - "
                + " - ".join(
                    f"{k}: {record.metrics[k]:.4f}"
                    for k in logs
                    if k in record.metrics and k != "lr"
                )
                + f" - {record.samples_per_sec:,.0f} samples/s"
            )
        if at.stop_pending:
            run.preempt(at.global_step)

    def _position(self) -> Progress:
        return Progress(epoch=self.at.epoch, offset=self.at.step * self.examples_per_step)
