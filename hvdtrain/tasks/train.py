"""The Task path's driver: shard, build, wrap, restore, train in compiled calls, evaluate.

It never names a task (see ``task.py``) and never asks for a rank (see ``hvdtrain.distributed``).
A run's life around the loop (run directory, checkpoints and resume, SIGTERM, divergence,
the watchdog, the result) is the run engine's (``hvdtrain.engine``), shared with the fit path;
the compiled steps are ``step.py``'s, and the epochs' loop is ``epochs.py``'s.
"""

from __future__ import annotations

import dataclasses

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
from hvdtrain.engine import preflight
from hvdtrain.engine.fronts import CommandLine
from hvdtrain.engine.run import Run
from hvdtrain.inputs import pipeline
from hvdtrain.inputs.arrays import steps_per_epoch, test_shard
from hvdtrain.inputs.sources import is_dataset
from hvdtrain.tasks.epochs import Epochs
from hvdtrain.tasks.step import TrainStep
from hvdtrain.tasks.task import Task, check_data, check_metrics, check_optimizer, check_task

EVAL_BATCH = 1000  # evaluation has no collectives inside, so its batch is free to choose


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
        epochs = Epochs(
            self.task,
            run,
            self.step,
            self.sums,
            ["loss"] + list(self.metric_fns),
            self.update_batch,
            self.steps,
            self.pipe,
            len(self.data.x_train) if self.pipe is None else self.pipe.examples,
        )
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
