"""The Task path's driver: shard, build, wrap, restore, train in compiled calls, evaluate.

It never names a task (see ``task.py``) and never asks for a rank (see ``hvdtrain.distributed``).
A run's life around the loop (run directory, checkpoints and resume, SIGTERM, divergence,
the watchdog, the result) is the run engine's (``hvdtrain.engine``), shared with the fit path;
the compiled steps are ``step.py``'s.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from hvdtrain import distributed
from hvdtrain.base import compat, precision, timings
from hvdtrain.base.config import Config
from hvdtrain.base.errors import (  # noqa: F401
    EXIT_PREEMPTED,
    ConfigError,
    DataError,
    Diverged,
    Preempted,
    StepError,
    TaskError,
    step_failed,
)
from hvdtrain.distributed.optimizer import DistributedOptimizer
from hvdtrain.distributed.world import steps_done
from hvdtrain.engine import preflight
from hvdtrain.engine.fronts import CommandLine
from hvdtrain.engine.report import EpochRecord
from hvdtrain.engine.run import Run
from hvdtrain.inputs import pipeline
from hvdtrain.inputs.arrays import epoch_plan, steps_per_epoch, test_shard
from hvdtrain.inputs.sources import is_dataset
from hvdtrain.tasks.step import TrainStep
from hvdtrain.tasks.task import Task, check_data, check_metrics, check_optimizer, check_task

EVAL_BATCH = 1000  # evaluation has no collectives inside, so its batch is free to choose
# --steps-per-execution 0 (auto): see _TaskRun._tune and docs/performance/speed.md.
AUTO_CALL_SECONDS = 0.05
AUTO_MAX_STEPS = 64


def train(task: Task, config: Config | None = None, world: distributed.World | None = None) -> dict:
    """Train a task on every rank, and return the result.

    Call it on every rank. Rank 0 prints and writes the run directory; a run directory that
    holds checkpoints is resumed from the newest (``Config.resume``).

    Args:
        task: the ``Task`` to train.
        config: the run's settings (default: the task's own, ``task.config()``).
        world: the World to train in (default: Horovod started, or one process, as
            ``config.backend`` says).

    Returns:
        The result, as result.json holds it (``final_loss``, the metrics, the timings,
        ...), on every rank.

    Raises:
        Error: one line, with its exit status (``hk.report_error`` says it): ``ConfigError``
            for a bad setting, ``TaskError`` when the task breaks the Task interface's
            rules, ``Preempted`` after a SIGTERM (rerun to resume), ...
    """
    with timings.phase("other"):  # the run: what no named phase inside claims
        compat.keras()  # fail early, with one line, if the Keras in use cannot train here
        check_task(task)
        config = (config or task.config()).validate()
        world = world or distributed.init(
            config.backend, config.num_workers, elastic=config.elastic
        )
        with Run(world, config, CommandLine(task.name), task.settings) as run:
            return _TaskRun(task, run).run()


class _TaskRun:
    """A Task's run on this rank, over the engine's ``Run``."""

    def __init__(self, task: Task, run: Run):
        self.task, self.run_, self.config, self.world = task, run, run.config, run.world
        self.out = run.out
        # The learning rate reaches the task once, as the run applies it (scaled): in
        # build_optimizer's argument and in the config it is handed.
        self.lr = run.learning_rate
        self.task_config = dataclasses.replace(self.config, learning_rate=self.lr)
        self.global_batch = 0  # examples of one update over all ranks (_shape)

    # --- setup ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Build everything, then train: statically, or under Horovod's elastic driver."""
        run = self.run_
        run.check_run_dir()
        if run.finished is not None:  # the same command again: its result stands
            self.out.notice(run.unchanged())
            return run.finished
        self._load()
        self._build()
        if not self.config.elastic:
            # Before anything is written, and before the broadcast, which mismatched shapes
            # would break (elastic runs: inside the driver, in _train).
            self._preflight()
        run.claim()
        progress = run.restore(self.model, self.optimizer)
        if self.config.elastic:
            # Horovod: the driver broadcasts rank 0's variables and progress at every
            # (re)start, restores the last commit after a failure, and re-runs _train.
            return self.world.run_elastic(run.state, self._train, **progress.fields())
        run.broadcast()
        return self._train(progress)

    @timings.timed("data")
    def _load(self) -> None:
        """The task's data, checked, sharded and counted."""
        task, config, world, run = self.task, self.task_config, self.world, self.run_
        # The task's own code, checked where it is called: an error in it (or a broken rule
        # of the interface) stops every rank with one line, before anything is written.
        self.data = run.user(
            f"{type(task).__name__}.load_data",
            task.load_data,
            config,
            world,
            catch=(DataError, OSError),
        )
        check_data(task, self.data)
        self.pipe = self._pipeline() if is_dataset(self.data.x_train) else None
        # A test pipeline's shards, counted now: an empty one is said before training.
        self.test = (
            pipeline.validation(self.data.x_test, world, batch=EVAL_BATCH, what="x_test")[0]
            if is_dataset(self.data.x_test)
            else None
        )
        run.use_input(self.pipe, self.pipe.identity() if self.pipe is not None else None)
        self._shape()

    @timings.timed("model")
    def _build(self) -> None:
        """The model, the distributed optimizer with its slots, the metrics and the step."""
        import tensorflow as tf

        task, config, world, run = self.task, self.task_config, self.world, self.run_
        keras, name = compat.keras(), type(task).__name__
        keras.utils.set_random_seed(config.seed)  # rank 0's init wins anyway (broadcast below)
        with precision.policy(config.mixed_precision):  # the layers keep it, the process not
            self.model = run.user(f"{name}.build_model", task.build_model, config)
        compat.check_model(self.model, f"{name}.build_model")
        optimizer = check_optimizer(
            task, run.user(f"{name}.build_optimizer", task.build_optimizer, config, self.lr)
        )
        # float16: loss scaling, composed with the reduction so that every rank skips alike.
        self.optimizer = DistributedOptimizer(
            precision.with_loss_scaling(optimizer, config.mixed_precision), world=world
        )
        # Create the optimizer's slots now so that one broadcast covers the whole state.
        self.optimizer.build(self.model.trainable_variables)
        self.metric_fns = check_metrics(task, run.user(f"{name}.metrics", task.metrics))
        self.sums = tf.Variable(tf.zeros(2 + len(self.metric_fns), tf.float64), trainable=False)
        self.step = TrainStep(
            task,
            self.model,
            self.optimizer,
            world,
            self.data,
            self.sums,
            self.metric_fns,
            self.config.accumulate_steps,
        )
        if self.pipe is not None:
            self.step.sample = self.pipe.first  # what the checks below run on
        # The loss and metrics' shapes on two examples, before anything is written.
        run.user(f"{name}'s loss, metrics or preprocess", self.step.check)

    def _pipeline(self) -> pipeline.Batches:
        """load_data's tf.data pipeline of examples, batched, sharded and counted."""
        if self.config.elastic:
            raise ConfigError(
                "elastic",
                True,
                "not with a tf.data pipeline from load_data (its "
                "shards change with the world size): give arrays, or drop it",
            )
        if not self.config.batch_size:
            raise ConfigError(
                "batch_size",
                self.config.batch_size,
                "a tf.data pipeline from load_data needs a batch size (per worker)",
            )
        if self.config.accumulate_steps > 1:
            # A pipeline's last batch may be short, and micro-batches split a step's batch
            # evenly: not offered yet (arrays from load_data, or hk.fit, accumulate).
            raise ConfigError(
                "accumulate_steps",
                self.config.accumulate_steps,
                "not with a tf.data pipeline from load_data: give arrays, or "
                "use hk.fit with DistributedOptimizer(backward_passes_per_step)",
            )
        train = self.data.x_train
        if int(train.cardinality()) == -1:  # tf.data.INFINITE_CARDINALITY
            raise TaskError(
                f"{type(self.task).__name__}.load_data: x_train repeats forever; "
                "hvdtrain runs the epochs: leave out the repeat()"
            )
        return pipeline.Batches(train, self.world, what="x_train", batch=self.config.batch_size)

    def _shape(self) -> None:
        """Batch and steps for the current world size (it changes in elastic runs)."""
        if self.pipe is not None:
            self.batch = self.update_batch = self.config.batch_size
            self.steps = self.pipe.steps
            self.global_batch = self.batch * self.world.size
            return
        n, size, micro = len(self.data.x_train), self.world.size, self.config.accumulate_steps
        # Full batch (None or 0): each worker's whole shard per step, as the linear seed does
        # (in ``micro`` micro-batches when accumulating).
        self.batch = self.config.batch_size or n // (size * micro)  # per micro-batch
        # A step is an update: ``micro`` micro-batches of ``batch`` on each worker, taken as
        # one batch of micro * batch from the epoch's plan, so the data position (counted in
        # examples) means the same with or without accumulation.
        self.update_batch = self.batch * micro
        self.steps = steps_per_epoch(n, self.update_batch, size) if self.batch else 0
        if self.steps < 1 and micro > 1:
            raise ConfigError(
                "accumulate_steps",
                micro,
                f"{micro} micro-batches of "
                f"{self.batch} x {size} workers need more than the {n} "
                "training examples",
            )
        if self.steps < 1:
            raise ConfigError(
                "batch_size",
                self.batch,
                f"a global batch of {self.batch} x "
                f"{size} workers needs more than the {n} training examples",
            )
        self.global_batch = self.update_batch * size

    @timings.timed("agreement")
    def _preflight(self) -> None:
        """All ranks must agree on versions, settings, variables and step counts before the
        first step, or they would hang or train wrong."""
        preflight.check(
            self.world,
            preflight.facts(
                self.world, self.config, self.task.settings, self.model, self.steps, self.data
            ),
        )

    def _train(self, progress) -> dict:
        """Every rank, after the state is in sync: check, loop, evaluate, report."""
        import tensorflow as tf

        world, config, run = self.world, self.config, self.run_
        self._shape()
        if config.elastic:
            self._preflight()  # a worker may have joined: check it too
        if progress.epoch is None:  # a fresh start
            progress.epoch, progress.offset, progress.sums = 0, 0, None
        # Rank 0 holds the epoch's partial sums (restored or committed); the others add theirs.
        self.sums.assign(
            progress.sums
            if world.is_chief and progress.sums is not None
            else tf.zeros_like(self.sums)
        )
        run.start(progress, self.global_batch)
        micro = (
            f" in {config.accumulate_steps} micro-batches of {self.batch}"
            if config.accumulate_steps > 1
            else ""
        )
        self.out.print(
            f"hvdtrain: {self.task.name} on {world.describe()}; global batch "
            f"{self.update_batch * world.size} ({self.update_batch} per worker"
            f"{micro}), {self.steps} steps per epoch, learning rate {self.lr:g}; "
            f"run dir {self.run_.dir}"
        )
        step = run.global_step
        if step:
            source = f" from {progress.path}" if progress.path else ""
            self.out.notice(f"hvdtrain: resumed{source} at epoch {progress.epoch + 1}, step {step}")
        epochs = _Epochs(self)
        with timings.phase("training"):
            while progress.epoch < config.epochs:
                epochs.train(progress)
        return self._finish()

    # --- after the loop -------------------------------------------------------------------------
    def _finish(self) -> dict:
        data, world = self.data, self.world
        examples = (
            self.pipe.info() if self.pipe is not None else {"train_examples": len(data.x_train)}
        )
        result = {
            "batch_size": self.batch,
            "global_batch_size": self.update_batch * world.size,
            **examples,
            **data.info,
        }
        with timings.phase("evaluation"):
            if data.x_test is not None:
                self.run_.sync_state()  # every rank scores its part with the same statistics
                result.update(self._evaluate())
            result.update(self.task.summarize(self.model))
        result = self.run_.finish(result, self.model)
        self.out.print(self.task.format_result(result), level=1)
        return result

    def _evaluate(self) -> dict:
        """Loss and metrics over the whole test set: each rank scores its part, sums combine."""
        import tensorflow as tf

        @tf.function(reduce_retracing=True, autograph=False)  # as TrainStep's (step.py): the
        # task's code in it is converted
        def eval_step(x, y):
            x, y = self.step.preprocess(x, y)
            return self.step.scores(y, self.model(x, training=False))[1]

        data, world = self.data, self.world
        local = np.zeros(2 + len(self.metric_fns))
        if self.test is not None:  # each example scored by one rank
            batches = self.test
        else:
            idx = test_shard(len(data.x_test), world.rank, world.size)
            batches = (
                (tf.constant(data.x_test[part]), tf.constant(data.y_test[part]))
                for part in (idx[i : i + EVAL_BATCH] for i in range(0, len(idx), EVAL_BATCH))
            )
        for x, y in batches:
            local += eval_step(x, y).numpy()
        totals = world.allreduce_sum(local)
        result = {"test_examples": int(totals[1]), "test_loss": float(totals[0] / totals[1])}
        result.update(
            {f"test_{k}": float(totals[2 + i] / totals[1]) for i, k in enumerate(self.metric_fns)}
        )
        return result


class _Epochs:
    """The Task path's loop: each epoch in compiled calls of several steps, its record."""

    def __init__(self, owner: _TaskRun):
        self.task, self.config, self.world, self.run_ = (
            owner.task,
            owner.config,
            owner.world,
            owner.run_,
        )
        self.out, self.step, self.sums = owner.out, owner.step, owner.sums
        # batch: the examples of one update on this rank (all its micro-batches)
        self.batch, self.steps, self.pipe = owner.update_batch, owner.steps, owner.pipe
        self.examples = len(owner.data.x_train) if self.pipe is None else self.pipe.examples
        self.names = ["loss"] + list(owner.metric_fns)
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
