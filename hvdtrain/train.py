"""The one training loop every task uses: shard, build, wrap, restore, train, evaluate, report.

It never names a task (see ``task.py``) and never asks for a rank (see ``distributed.py``).
Fault tolerance lives here too: checkpoints every N steps and at epoch ends, exact resume,
a SIGTERM that stops every rank at the same step boundary, and the peer watchdog.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

import numpy as np

from hvdtrain import checkpoint, compat, distributed, preflight
from hvdtrain.config import Config, ConfigError, values
from hvdtrain.data import DataError, epoch_plan, steps_per_epoch, test_shard
from hvdtrain.report import Reporter, RunDirBusy, weights_agreement
from hvdtrain.resume import Checkpointing
from hvdtrain.step import TrainStep
from hvdtrain.task import Task, TaskError
from hvdtrain.watchdog import Watchdog

EVAL_BATCH = 1000  # evaluation has no collectives inside, so its batch is free to choose
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM after saving; rerun to resume
PROGRESS_FIELDS = ("epoch", "offset", "sums", "last_record", "path")
# --steps-per-execution 0 (auto): see _Run._tune and docs/PERFORMANCE.md.
AUTO_CALL_SECONDS = 0.05
AUTO_MAX_STEPS = 64


class Preempted(RuntimeError):
    """SIGTERM reached a rank; every rank stopped after the same step, rank 0 saved."""


class Diverged(RuntimeError):
    """The loss (or the weights) became NaN or infinite; every rank stopped at that step."""


class StepError(RuntimeError):
    """A training step failed on this rank (e.g. a label outside the model's classes)."""


def train(task: Task, config: Optional[Config] = None,
          world: Optional[distributed.World] = None) -> dict:
    """Train ``task`` under ``config`` (default: the task's own defaults) on every rank and
    return the result (all ranks).

    Rank 0 prints and writes the run directory. Raises ConfigError, DataError, TaskError,
    distributed.LaunchError / RankError, compat.KerasVersionError, RunDirBusy, Diverged,
    StepError, or Preempted.
    """
    compat.keras()  # fail early, with one line, if the Keras in use cannot train here
    config = (config or task.config()).validate()
    world = world or distributed.init(config.backend, config.num_workers)
    # Elastic runs survive a lost worker by design: Horovod's driver, not the watchdog, acts.
    dog = Watchdog(world, 0 if config.elastic else config.peer_timeout).start()
    try:
        result = _Run(task, config, world, dog).run()
    except (ConfigError, distributed.RankError, Preempted, compat.KerasVersionError, TaskError,
            Diverged):
        dog.close()  # every rank raised the same error; nobody waits for anyone
        raise
    except BaseException as e:
        if "Horovod" in str(e):
            # A collective failed because a peer is gone; the watchdog, which names that
            # peer, usually ends this process first. When Horovod's error wins the race,
            # give the watchdog's verdict a moment to arrive, then say it in one line.
            dog.await_verdict(5.0)
            dog.abort(distributed.error_line(e))
            raise distributed.RankError(f"rank {world.rank}: a collective failed (a peer is "
                                        f"gone?): {distributed.first_line(str(e))}") from None
        dog.abort(f"{type(e).__name__}: {e}")  # this rank alone: stop the others too
        raise
    dog.close()
    return result


def _op_error_line(message: str) -> str:
    """The cause in a TensorFlow op error: not the "Graph execution error:" header, the
    "Detected at node" trace or the node name, but the kernel's own message."""
    skip = ("Graph execution error", "Detected at node", "File ", "[[", "Traceback")
    lines = [l.strip() for l in str(message).splitlines() if l.strip()]
    causes = [l for l in lines if not l.startswith(skip)]
    return causes[0] if causes else distributed.first_line(message)


class _Run(Checkpointing):
    def __init__(self, task, config, world, dog):
        self.task, self.config, self.world, self.dog = task, config, world, dog
        self.out = Reporter(world, config.run_dir, task.name, config.verbose)
        self.ckpt_dir = self.out.run_dir + "/checkpoints"
        self.stop_requested = False
        self.last_record = None  # the newest finished epoch's metrics (kept in checkpoints)
        self.auto_steps = 1  # updates per compiled call, when tuned (the first call traces)

    # --- setup ------------------------------------------------------------------------------
    def run(self) -> dict:
        """Build everything, then train: statically, or under Horovod's elastic driver.

        In elastic mode nothing before the elastic function may be a collective: a worker
        that joins later runs this setup while the others wait inside the driver's sync.
        """
        import tensorflow as tf

        task, config, world = self.task, self.config, self.world
        keras = compat.keras()
        # The run directory first: a file in its place, no permission or a finished run in it
        # would otherwise fail late (after the data loaded) or be overwritten.
        problem = self.out.problem() if config.elastic else world.broadcast_object(
            self.out.problem())
        if problem:
            raise ConfigError("run_dir", self.out.run_dir, problem)
        load = lambda: task.load_data(config, world)  # noqa: E731
        self.data = load() if config.elastic else world.agree(load, catch=(DataError, OSError))
        self._shape()

        keras.utils.set_random_seed(config.seed)  # rank 0's init wins anyway (broadcast below)
        self.model = task.build_model(config)
        compat.check_model(self.model, f"{type(task).__name__}.build_model")
        self.lr = config.learning_rate * (world.size if config.scale_lr else 1)
        self.optimizer = world.wrap_optimizer(task.build_optimizer(config, self.lr))
        # Create the optimizer's slots now so that one broadcast covers the whole state.
        self.optimizer.build(self.model.trainable_variables)
        self.metric_fns = task.metrics()
        self.sums = tf.Variable(tf.zeros(2 + len(self.metric_fns), tf.float64), trainable=False)
        self.variables = list(self.model.variables) + list(self.optimizer.variables) + [self.sums]
        self.step = TrainStep(task, self.model, self.optimizer, world, self.data, self.sums,
                              self.metric_fns)
        self.step.check()  # a reduced loss is refused here, before anything is written

        # Everything is checked: rank 0 takes the run directory for this run (a second run on
        # it is refused while this one lives), then looks for a checkpoint to resume from.
        if config.elastic:  # no collectives before the elastic driver; see the README
            self.out.claim()
        else:
            world.agree(self.out.claim, catch=(RunDirBusy, OSError))
        find = self._find_checkpoint
        found = find() if config.elastic else world.agree(find, catch=(checkpoint.CheckpointError,))
        restore = lambda: self._restore(found) if world.is_chief else None  # noqa: E731
        progress = restore() if config.elastic else world.broadcast_object(
            world.agree(restore, catch=(checkpoint.CheckpointError,)))
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            if config.elastic:
                # Horovod: the driver broadcasts rank 0's variables and progress at every
                # (re)start, restores the last commit after a failure, and re-runs _train.
                fields = progress or {}
                return world.run_elastic(self.variables[:-1], self._train,
                                         **{k: fields.get(k) for k in PROGRESS_FIELDS})
            self._preflight()  # before the broadcast, which mismatched shapes would break
            # Horovod: every rank starts from rank 0's state, initial or restored.
            world.broadcast_variables(self.variables[:-1])
            return self._train(distributed.Progress(**progress))
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.out.release()

    def _shape(self) -> None:
        """Batch and steps for the current world size (it changes in elastic runs)."""
        n, size = len(self.data.x_train), self.world.size
        # Full batch (None or 0): each worker's whole shard per step, as the linear seed does.
        self.batch = self.config.batch_size or n // size
        self.steps = steps_per_epoch(n, self.batch, size) if self.batch else 0
        if self.steps < 1:
            raise ConfigError("batch_size", self.batch, f"a global batch of {self.batch} x "
                              f"{size} workers needs more than the {n} training examples")

    def _preflight(self) -> None:
        """All ranks must agree on versions, settings, variables and step counts before the
        first step, or they would hang or train wrong."""
        preflight.check(self.world, preflight.facts(self.world, self.config, self.task.settings,
                                                    self.model, self.steps, self.data))

    def _train(self, progress) -> dict:
        """Every rank, after the state is in sync: check, loop, evaluate, report."""
        import tensorflow as tf

        world, config = self.world, self.config
        self._shape()
        if config.elastic:
            self._preflight()  # a worker may have joined: check it too
        if progress.epoch is None:  # a fresh start
            progress.epoch, progress.offset, progress.sums = 0, 0, None
        # Rank 0 holds the epoch's partial sums (restored or committed); the others add theirs.
        self.sums.assign(progress.sums if world.is_chief and progress.sums is not None
                         else tf.zeros_like(self.sums))
        self.last_record = progress.last_record
        self.out.start({**self._run_dict(), "world_size": world.size, "backend": world.backend,
                        "keras": compat.describe()},
                       completed_epochs=progress.epoch)
        self.out.print(f"hvdtrain: {self.task.name} on {world.describe()}; global batch "
                       f"{self.batch * world.size} ({self.batch} per worker), {self.steps} steps "
                       f"per epoch, learning rate {self.lr:g}; run dir {self.out.run_dir}")
        step = int(self.optimizer.iterations.numpy())
        if step:
            source = f" from {progress.path}" if progress.path else ""
            self.out.notice(f"hvdtrain: resumed{source} at epoch {progress.epoch + 1}, step {step}")
        self._loop(progress)
        return self._finish()

    def _run_dict(self, defines_run=None) -> dict:
        """The task's name, the training settings and the task's own (all, or only those that
        define the run): what config.json shows and what a resume compares."""
        return {"task": self.task.name, **values(self.config, defines_run=defines_run),
                "settings": values(self.task.settings, defines_run=defines_run)}

    def _on_sigterm(self, signum, frame):
        self.stop_requested = True

    # --- the loop -----------------------------------------------------------------------------
    def _loop(self, progress) -> None:
        """Train from ``progress`` (epoch, examples done in it) to the last epoch."""
        import tensorflow as tf

        config, world, out, keras = self.config, self.world, self.out, compat.keras()
        names = ["loss"] + list(self.metric_fns)
        global_batch = self.batch * world.size
        while progress.epoch < config.epochs:
            epoch = progress.epoch
            # After a resume or reset with another world size, continue after the same
            # examples, rounded up to a whole global batch of the new size.
            first = min(-(-progress.offset // global_batch), self.steps)
            plan = epoch_plan(len(self.data.x_train), self.batch, world.rank, world.size,
                              config.seed, epoch)[first:]
            bar = None
            # Keras 3's bar always draws with terminal escapes: in a pipe or log (horovodrun,
            # SLURM) print one line per epoch instead, as Keras 2's bar did there.
            if out.verbose == 1 and self.task.progress_bar and out.interactive:
                out.print(f"Epoch {epoch + 1}/{config.epochs}")
                bar = keras.utils.Progbar(self.steps, stateful_metrics=names + ["samples/s"])
            # Each step adds exactly one to optimizer.iterations: count in Python instead of
            # reading the variable back every step (one device-to-host copy fewer per step).
            base_step = int(self.optimizer.iterations.numpy()) - first
            batches, step = self.step.batches(plan), first
            tick = time.perf_counter()
            while step < self.steps:
                # Several updates per compiled call, ending on every step that must be seen by
                # the host: a checkpoint's, an elastic commit's, the epoch's last.
                n = self._steps_per_call(base_step + step, self.steps - step)
                started = time.perf_counter()
                try:
                    done, stop, diverged = self.step.run(batches, n, self.stop_requested)
                except tf.errors.InvalidArgumentError as e:
                    # Bad input on this rank alone (e.g. a label the model has no class for):
                    # one line; the watchdog stops the others. Horovod's own errors (a lost
                    # peer) are not this class and pass through: elastic runs recover from them.
                    where = base_step + step + 1
                    where = (f"training step {where}" if n == 1 else
                             f"one of training steps {where}-{where + n - 1}")
                    raise StepError(f"{where} failed on rank {world.rank}: "
                                    f"{_op_error_line(e.message)}") from None
                self._tune(time.perf_counter() - started, done)
                step += done
                global_step = base_step + step
                if diverged and config.stop_on_divergence:
                    raise self._diverged(f"the loss became NaN or infinite at step "
                                         f"{global_step}")
                self.dog.step, progress.offset = global_step, step * global_batch
                if stop or (config.checkpoint_every and global_step % config.checkpoint_every == 0
                            and step < self.steps):
                    self._save(progress)
                if stop:
                    world.barrier()  # nobody exits (and gets the job killed) before the save
                    raise Preempted(f"stopped by SIGTERM at step {global_step}; checkpoint saved "
                                    f"in {self.ckpt_dir}; run the same command to resume")
                if config.elastic and global_step % config.commit_every == 0 and step < self.steps:
                    self._commit(progress)
                if bar is not None and step < self.steps:
                    every = max(1, self.steps // 20)
                    if step // every > (step - done) // every:
                        local = self.sums.numpy()  # rank 0's running means, for the eye only
                        bar.update(step, [(k, local[0 if i == 0 else i + 1] / local[1])
                                          for i, k in enumerate(names)])
            totals = world.allreduce_sum(self.sums.numpy())  # exact sums over every rank
            elapsed = time.perf_counter() - tick
            self.last_record = record = {
                "epoch": epoch + 1, "epochs": config.epochs,
                "global_step": int(self.optimizer.iterations.numpy()),
                "loss": float(totals[0] / totals[1]),
                **{k: float(totals[2 + i] / totals[1]) for i, k in enumerate(self.metric_fns)},
                # examples this process trained in the epoch (fewer after a resume), per second
                "samples_per_sec": (self.steps - first) * global_batch / elapsed,
                "seconds": elapsed, "world_size": world.size}
            progress.epoch, progress.offset = epoch + 1, 0
            self.sums.assign(tf.zeros_like(self.sums))
            out.epoch(record)
            self._save(progress)
            if config.elastic:
                self._commit(progress)
            if bar is not None:
                bar.update(self.steps, [(k, record[k]) for k in names] +
                           [("samples/s", record["samples_per_sec"])], finalize=True)
            else:
                out.print(self.task.format_epoch(record))

    def _steps_per_call(self, global_step: int, left: int) -> int:
        """Updates in the next compiled call: the setting (or the tuned value), cut so that the
        call ends on the next checkpoint, elastic commit or epoch end."""
        n = min(self.config.steps_per_execution or self.auto_steps, left)
        for every in (self.config.checkpoint_every,
                      self.config.commit_every if self.config.elastic else 0):
            if every:
                n = min(n, every - global_step % every)
        return n

    def _tune(self, seconds: float, done: int) -> None:
        """--steps-per-execution 0 (auto): size calls to take about AUTO_CALL_SECONDS, so the
        host's cost per call is small against them and SIGTERM is seen within about that
        time; at most doubling from one call to the next, at most AUTO_MAX_STEPS."""
        if done:
            fit = int(AUTO_CALL_SECONDS * done / max(seconds, 1e-9))
            self.auto_steps = max(1, min(AUTO_MAX_STEPS, 2 * self.auto_steps, fit))

    def _diverged(self, what: str) -> Diverged:
        newest = checkpoint.list_checkpoints(self.ckpt_dir)
        kept = (f"the newest checkpoint, from before it, is step {newest[0][0]} in "
                f"{self.ckpt_dir}" if newest else "no checkpoint was saved before it")
        return Diverged(f"{what}: training stopped ({kept}); try a lower --learning-rate in a "
                        "new --run-dir, or --no-stop-on-divergence to train on")

    def _finish(self) -> dict:
        config, world, data, last = self.config, self.world, self.data, self.last_record
        result = {
            "task": self.task.name, "backend": world.backend, "world_size": world.size,
            "global_step": int(self.optimizer.iterations.numpy()), "epochs": config.epochs,
            "batch_size": self.batch, "global_batch_size": self.batch * world.size,
            "learning_rate": self.lr, "train_examples": len(data.x_train),
            "keras": compat.describe(),
            "final_loss": last["loss"], **{f"final_{k}": last[k] for k in self.metric_fns},
            **data.info,
        }
        if data.x_test is not None:
            result.update(self._evaluate())
        result.update(self.task.summarize(self.model))
        result.update(weights_agreement(world, self.model))
        if config.save_model:
            result["model"] = self.out.save_model(self.model)
        self.out.result(result)
        self.out.print(self.task.format_result(result), level=1)
        return result

    def _evaluate(self) -> dict:
        """Loss and metrics over the whole test set: each rank scores its part, sums combine."""
        import tensorflow as tf

        @tf.function(reduce_retracing=True)
        def eval_step(x, y):
            x, y = self.task.preprocess(x, y)
            return self.step.scores(y, self.model(x, training=False))[1]

        data, world = self.data, self.world
        idx = test_shard(len(data.x_test), world.rank, world.size)
        local = np.zeros(2 + len(self.metric_fns))
        for start in range(0, len(idx), EVAL_BATCH):
            part = idx[start:start + EVAL_BATCH]
            local += eval_step(tf.constant(data.x_test[part]), tf.constant(data.y_test[part])).numpy()
        totals = world.allreduce_sum(local)
        result = {"test_examples": int(totals[1]), "test_loss": float(totals[0] / totals[1])}
        result.update({f"test_{k}": float(totals[2 + i] / totals[1])
                       for i, k in enumerate(self.metric_fns)})
        return result
