"""The Task path's loop: each epoch in compiled calls of several steps, and its record.

``train.py`` builds everything and hands it here; ``Epochs.train`` runs one epoch (or its rest
after a resume) in calls of ``--steps-per-execution`` updates, checkpoints, commits, prints
progress and ends with the epoch's exact metrics over every rank.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hvdtrain.base import compat, timings
from hvdtrain.base.errors import step_failed
from hvdtrain.distributed.world import steps_done
from hvdtrain.engine.report import EpochRecord
from hvdtrain.engine.run import Run
from hvdtrain.inputs import pipeline
from hvdtrain.inputs.arrays import epoch_plan
from hvdtrain.tasks.step import TrainStep
from hvdtrain.tasks.task import Task

# --steps-per-execution 0 (auto): see Epochs._tune and docs/performance/speed.md.
AUTO_CALL_SECONDS = 0.05
AUTO_MAX_STEPS = 64


class Epochs:
    """The Task path's loop: each epoch in compiled calls of several steps, its record.

    Args:
        task: the Task trained (its ``format_epoch`` and ``progress_bar``).
        run: the engine's ``Run`` (its config, world and reporter).
        step: the compiled ``TrainStep``.
        sums: the tf.Variable the step adds the epoch's loss, count and metric sums to.
        names: "loss", then the task's metrics, in the order of the sums.
        batch: the examples of one update on this rank (all its micro-batches).
        steps: the updates in one epoch.
        pipe: load_data's tf.data pipeline, or None for arrays.
        examples: the training examples (one epoch's).
    """

    def __init__(
        self,
        task: Task,
        run: Run,
        step: TrainStep,
        sums: Any,
        names: list[str],
        batch: int,
        steps: int,
        pipe: pipeline.Batches | None,
        examples: int,
    ):
        self.task, self.run_, self.config, self.world = task, run, run.config, run.world
        self.out, self.step, self.sums = run.out, step, sums
        self.batch, self.steps, self.pipe, self.examples = batch, steps, pipe, examples
        self.names = names
        self.auto_steps = 1  # updates per compiled call, when tuned (the first call traces)
        # A tf.data pipeline's batches: one iterator for the rest of the run, not one per
        # epoch: deleting an iterator whose autotuner runs (a map's AUTOTUNE) joins its
        # tuning thread, 3-9 s at each epoch's end on 2 busy cores.
        self.stream = None
        self.finished = int(self.step.finished.numpy())  # step.finished before the next call
        self.epoch, self.stopped = 0, False  # the epoch in training; SIGTERM seen by a call

    def train(self, progress) -> None:
        """Train the rest of ``progress.epoch`` (from ``progress.offset`` examples into it)."""
        import tensorflow as tf

        config, world, run = self.config, self.world, self.run_
        epoch, global_batch = progress.epoch, self.batch * world.size
        first = steps_done(progress, global_batch, self.steps)
        if self.pipe is not None:  # all ranks: no input changed since the last look
            self.pipe.check_unchanged(f"before epoch {epoch + 1}")
        self.epoch = epoch
        if self.pipe is None:
            batches = self.step.batches(
                epoch_plan(self.examples, self.batch, world.rank, world.size, config.seed, epoch)[
                    first:
                ]
            )
        else:
            if self.stream is None:
                self.stream = self.step.batches(self.pipe.batches(epoch, config.epochs, first))
            batches = self.stream
        bar = self._progress_bar(epoch)
        # Each step adds exactly one to optimizer.iterations: count in Python instead of
        # reading the variable back every step (one device-to-host copy fewer per step).
        base_step = run.global_step - first
        step = first
        tick = time.perf_counter()
        self.out.epoch_began()
        while step < self.steps:
            done = self._call(batches, base_step, step)
            step += done
            global_step = base_step + step
            run.reached(global_step)
            progress.offset = step * global_batch
            if self.stopped or (
                config.checkpoint_every
                and step < self.steps
                and global_step % config.checkpoint_every == 0
            ):
                run.save(progress, self._partial_sums())
            if self.stopped:
                run.preempt(global_step)
            if config.elastic and global_step % config.commit_every == 0 and step < self.steps:
                run.commit(progress, self._partial_sums())
            if bar is None and step < self.steps and self.out.progress_due():
                local = self.sums.numpy()  # rank 0's running means, for the eye only
                self.out.progress(
                    epoch + 1,
                    config.epochs,
                    step,
                    self.steps,
                    step - first,
                    global_batch,
                    {k: local[0 if i == 0 else i + 1] / local[1] for i, k in enumerate(self.names)},
                )
            if bar is not None and step < self.steps:
                every = max(1, self.steps // 20)
                if step // every > (step - done) // every:
                    local = self.sums.numpy()  # rank 0's running means, for the eye only
                    bar.update(
                        step,
                        [
                            (k, local[0 if i == 0 else i + 1] / local[1])
                            for i, k in enumerate(self.names)
                        ],
                    )
        totals = self._partial_sums()  # exact sums over every rank
        elapsed = time.perf_counter() - tick
        record = EpochRecord(
            epoch=epoch + 1,
            epochs=config.epochs,
            global_step=run.global_step,
            metrics={
                k: float(totals[0 if i == 0 else i + 1] / totals[1])
                for i, k in enumerate(self.names)
            },
            # examples this process trained in the epoch (fewer after a resume), per second
            samples_per_sec=(self.steps - first) * global_batch / elapsed,
            seconds=elapsed,
            world_size=world.size,
        )
        progress.epoch, progress.offset = epoch + 1, 0
        self.sums.assign(tf.zeros_like(self.sums))
        run.epoch_end(record)
        zeros = np.zeros_like(totals)  # a new epoch's sums: no allreduce needed to know them
        run.save(progress, zeros)
        if config.elastic:
            run.commit(progress, zeros)
        if bar is not None:
            bar.update(
                self.steps,
                [(k, record.metrics[k]) for k in self.names]
                + [("samples/s", record.samples_per_sec)],
                finalize=True,
            )
        else:
            self.out.print(self.task.format_epoch(record.as_dict()))

    def _progress_bar(self, epoch: int):
        """Keras' bar on a terminal; None in a pipe or log (horovodrun, SLURM): Keras 3's bar
        always draws with terminal escapes, so one line per epoch is printed there instead,
        as Keras 2's bar did."""
        if not (self.out.verbose == 1 and self.task.progress_bar and self.out.interactive):
            return None
        self.out.print(f"Epoch {epoch + 1}/{self.config.epochs}")
        return compat.keras().utils.Progbar(self.steps, stateful_metrics=self.names + ["samples/s"])

    def _call(self, batches, base_step: int, step: int) -> int:
        """One compiled call of several updates, ending on every step that must be seen by
        the host (a checkpoint's, an elastic commit's, the epoch's last). Returns the updates
        done; sets ``stopped`` when SIGTERM reached any rank; raises on divergence."""
        import tensorflow as tf

        n = self._steps_per_call(base_step + step, self.steps - step)
        started = time.perf_counter()
        finished = self.finished  # updates done before this call
        try:
            with timings.phase("first_call" if self.step.first else "training"):
                done, self.stopped, diverged = self.step.run(batches, n, self.run_.stop_requested)
        except tf.errors.OpError as e:
            # A tf.data input that changed under the run (a file cut short or deleted) on
            # this rank: one line naming it; the watchdog stops the others.
            error = self.pipe.failure(e, self.epoch) if self.pipe is not None else None
            if error is not None:
                raise error from None
            # Bad input on this rank alone (a label the model has no class for, a tf.data
            # map that raised): one line with the step (after the updates this call
            # finished); the watchdog stops the others.
            # Horovod's own errors (a lost peer) pass through: elastic runs recover from them.
            failed = base_step + step + int(self.step.finished.numpy()) - finished + 1
            raise step_failed(e, f"training step {failed}", self.world.rank) or e
        self.finished += done
        self._tune(time.perf_counter() - started, done)
        if diverged and self.config.stop_on_divergence:
            raise self.run_.diverged(
                f"the loss became NaN or infinite at step {base_step + step + done}"
            )
        return done

    def _steps_per_call(self, global_step: int, left: int) -> int:
        """Updates in the next compiled call: the setting (or the tuned value), cut so that the
        call ends on the next checkpoint, elastic commit or epoch end."""
        n = min(self.config.steps_per_execution or self.auto_steps, left)
        for every in (
            self.config.checkpoint_every,
            self.config.commit_every if self.config.elastic else 0,
        ):
            if every:
                n = min(n, every - global_step % every)
        return n

    def _tune(self, seconds: float, done: int) -> None:
        """--steps-per-execution 0 (auto): size calls to take about AUTO_CALL_SECONDS, so the
        host's cost per call is small against them and SIGTERM is seen within about that
        time; at most doubling from one call to the next, at most AUTO_MAX_STEPS."""
        if done and not self.config.steps_per_execution:
            fit = int(AUTO_CALL_SECONDS * done / max(seconds, 1e-9))
            self.auto_steps = max(1, min(AUTO_MAX_STEPS, 2 * self.auto_steps, fit))

    def _partial_sums(self) -> np.ndarray:
        """All ranks: the epoch's sums so far over every rank (what rank 0 keeps on resume)."""
        return self.world.allreduce_sum(self.sums.numpy())
