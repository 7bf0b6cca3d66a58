"""The run engine: one training run's life, the same under the Task loop and under ``model.fit``.

    with Run(world, config, CommandLine("mnist"), settings) as run:   # the watchdog; one-line errors
        run.check_run_dir()                               # before any data is loaded
        ... load data, build the model and optimizer ...
        run.claim()                                       # rank 0 holds the run directory
        progress = run.restore(model, optimizer)          # newest checkpoint, or a fresh start
        run.broadcast()                                   # every rank from rank 0's state
        run.start(progress, global_batch)                 # config.json, metrics.jsonl kept
        ... the driver trains, asking run.stop_requested (or run.should_stop()) and calling
            run.reached(step) / run.save(progress, sums) / run.epoch_end(EpochRecord(...)) /
            run.preempt(step) ...
        run.finish(result, model)                         # agreement, model.keras, result.json

Both drivers use it: ``hvdtrain.tasks.train`` (the Task path's compiled loop) and ``hvdtrain.fit``
(``hvdtrain.keras.fit``, Keras' own loop); neither keeps a copy of what is here: the run
directory (``rundir.RunDir``: checked before anything is loaded, held by rank 0 while the run
lives); checkpoints (found, the settings that define the run must match; restored on rank 0,
broadcast; saved by rank 0 with the data position and the epoch's metric sums so far over
every rank; committed in memory for elastic runs); SIGTERM and SIGINT (a flag every rank's
driver reduces: every rank stops after the same step, a checkpoint, ``Preempted``, exit 75);
storage (rank 0's ``StorageError`` is every rank's, at the write); divergence (NaN weights are
never checkpointed: ``Diverged``); the result (every rank's weights compared, the model saved,
result.json last); errors (raised on every rank together: said once; one rank's: the others
stopped by the watchdog; a failed collective: one line naming the rank). Only rank 0 reads
and writes files (``report.Reporter``). The frame of a run (watchdog, stop signals, errors
on every rank together) is ``frame.RunFrame``, the base of ``Run``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hvdtrain.base import compat, precision, timings
from hvdtrain.base.config import Config, values
from hvdtrain.base.errors import (
    CheckpointError,
    ConfigError,
    Diverged,
    EnvError,
    RanksDiffer,
    RunDirBusy,
    RunDirHeld,
    StorageError,
)
from hvdtrain.distributed.optimizer import updates
from hvdtrain.distributed.statistics import MovingStatistics
from hvdtrain.distributed.world import Progress, World
from hvdtrain.engine.agreement import ranks_differ_line, weights_agreement
from hvdtrain.engine.checkpoints import Checkpoints
from hvdtrain.engine.frame import RunFrame
from hvdtrain.engine.fronts import CommandLine, FitScript
from hvdtrain.engine.report import EpochRecord, Reporter
from hvdtrain.engine.rundir import RunDir

# An epoch whose steps waited for input this share of its time (slowest rank) is input-bound.
INPUT_BOUND = 0.5


class Run(RunFrame):
    """One run on this rank: see the module docstring for the order of calls.

    ``front`` is what the run serves (``fronts.CommandLine(task name)`` or
    ``fronts.FIT_SCRIPT``): the run's name, and how its refusals name the user's settings;
    ``settings`` is the driver's own settings dataclass (a task's ``Settings``), or None. The
    driver tells the run its input (``use_input``) and, at each start, its global batch
    (``start``: it changes with the world size in elastic runs); it sets no attribute.
    Its frame (the watchdog, SIGTERM and SIGINT, errors on every rank) is ``frame.RunFrame``.
    """

    def __init__(self, world: World, config: Config, front: CommandLine | FitScript, settings=None):
        super().__init__(world, config)  # the watchdog, the stop signals (frame.RunFrame)
        self.front, self.settings = front, settings
        self.name = front.name  # the task's, or "fit"
        with timings.phase("agreement"):  # the default run directory: rank 0's name for it
            self.dir = RunDir.resolve(config.run_dir, front.name, world)
        self.out = Reporter(world, self.dir, config.verbose, config.track, config.track_required)
        self.checkpoints = Checkpoints(world, config, self.dir.checkpoints, self.out.notice, front)
        # The learning rate the optimizer applies: the setting, times the world size with
        # scale_lr, fixed at the start (as the optimizer is); None: a schedule's (hk.fit).
        rate = config.learning_rate
        self.learning_rate = rate if rate is None or not config.scale_lr else rate * world.size
        self.finished: dict | None = None  # a finished run's result.json (check_run_dir)
        # The newest finished epoch's record (kept in checkpoints: result.json's final_*).
        self.last_record: EpochRecord | None = None
        self.global_batch = 0  # examples of one update over all ranks (start)
        self.model: Any | None = None  # Keras' model and optimizer (restore)
        self.optimizer: Any | None = None
        self.state: list = []  # model and optimizer variables: what a checkpoint holds
        self.moving = MovingStatistics(world, [])
        self.pipeline: Any | None = None  # the driver's tf.data input (use_input)
        self.input: dict = {}  # what identifies it besides the settings
        self._said_input_bound = False

    # --- before training ----------------------------------------------------------------------
    @timings.timed("agreement")
    def check_run_dir(self) -> None:
        """A file in its place, no permission or a finished run in it: refused before anything
        is loaded (it would fail late, or be overwritten)."""
        # A finished run is every rank's decision (rank 0 reads it): not in elastic runs,
        # which take no collective here, and resume from their checkpoints as before.
        # --no-resume is refused by the checkpoints as before.
        finished = self.collective and self.config.resume is not False
        problem = (
            self.out.problem(),
            self.out.finished(self.config.epochs, self.record(defines_run=True))
            if finished
            else None,
        )
        if self.collective:
            problem = self.world.broadcast_object(problem)
        problem, self.finished = problem
        if problem:
            raise ConfigError("run_dir", self.dir.path, problem)

    def unchanged(self) -> str:
        """A rerun of a finished run (``finished``): what the driver says instead of training."""
        done = self.finished
        assert done is not None  # the drivers ask only when check_run_dir found one
        return (
            f"hvdtrain: {self.dir} holds a finished run ({done.get('epochs')} "
            f"epochs, step {done.get('global_step')}): nothing to train, nothing "
            f"overwritten; a new {self.front.argument('run_dir')} trains again, more "
            f"{self.front.argument('epochs')} train on"
        )

    @timings.timed("agreement")
    def claim(self) -> None:
        """Everything is checked: rank 0 takes the run directory for this run (a second run
        on it is refused while this one lives)."""

        def take():  # rank 0's StorageError (the lock file) said as the others' saves are,
            try:  # and a lock held elsewhere too: both are every rank's exit status
                self.out.claim()
            except (StorageError, RunDirHeld, EnvError) as e:
                return type(e).__name__, str(e)
            return None

        error = self.agree(take, catch=(RunDirBusy, OSError))
        if self.collective:
            error = self.world.broadcast_object(error)
        if error is not None:
            kind, message = error
            raise {"RunDirHeld": RunDirHeld, "EnvError": EnvError}.get(kind, StorageError)(message)

    @timings.timed("checkpoints")
    def restore(self, model, optimizer, others=()) -> Progress:
        """Rank 0 loads its newest valid checkpoint into ``model`` and ``optimizer`` (built)
        and any ``others`` the model applies (a GAN's); every rank gets the position to start
        from. From here on SIGTERM and SIGINT stop the run at a step boundary instead of
        killing (interrupting) the process."""
        self.model, self.optimizer = model, optimizer
        self.state = (
            compat.variables(model.variables)
            + list(optimizer.variables)
            + precision.scaler_state(optimizer)
            + [v for o in others for v in o.variables]
        )
        self.moving = MovingStatistics(self.world, compat.variables(model.non_trainable_weights))
        find = lambda: self.checkpoints.find(self.record(defines_run=True))  # noqa: E731
        found = self.agree(find, catch=(CheckpointError,))
        load = lambda: self.checkpoints.load(found, self.state)  # noqa: E731
        fields = self.agree(load, catch=(CheckpointError,))
        if self.collective:
            fields = self.world.broadcast_object(fields)
        self.catch_signals()
        return Progress(**fields) if fields else Progress()

    @timings.timed("agreement")
    def broadcast(self) -> None:
        # Horovod: every rank starts from rank 0's state, initial or restored.
        self.world.broadcast_variables(self.state)

    def record(self, defines_run: bool | None = None) -> dict:
        """The run's name and settings (all, or only those that define the run): what
        config.json shows, what a checkpoint keeps, what a resume compares."""
        return {
            "task": self.name,
            **values(self.config, defines_run=defines_run),
            "settings": values(self.settings, defines_run=defines_run),
            **self.input,
        }

    def use_input(self, pipeline=None, identity: dict | None = None) -> None:
        """The driver's training input, once loaded: its tf.data ``pipeline`` (its input wait
        recorded each epoch, checked unchanged before each save), and what identifies it
        besides the settings (``identity``: its files, compared on resume)."""
        self.pipeline, self.input = pipeline, dict(identity or {})

    @timings.timed("results")
    def start(self, progress, global_batch: int) -> None:
        """Training starts from ``progress`` (again after an elastic reset): config.json;
        metrics.jsonl keeps the epochs a resume starts after. ``global_batch``: the examples
        of one update over all ranks at this world size (a checkpoint's step)."""
        self.global_batch, last = global_batch, progress.last_record
        self.last_record = EpochRecord.from_dict(last) if last is not None else None
        self.rank0_writes(
            self.out.start,
            {
                **self.record(),
                "world_size": self.world.size,
                "backend": self.world.backend,
                "keras": compat.describe(),
                "applied_learning_rate": self.learning_rate,
            },
            progress.epoch or 0,
        )

    def reached(self, global_step: int) -> None:
        """The driver's step so far: what the watchdog's heartbeat tells the other ranks."""
        self.dog.step = global_step

    # --- while training -----------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        return updates(self.optimizer)  # optimizer updates, also when accumulating

    def sync_state(self) -> None:
        """All ranks: the model's moving statistics averaged over the ranks (once a step)."""
        self.moving.sync(self.global_step)

    @timings.timed("checkpoints")
    def save(self, progress: Progress, partial_sums) -> None:
        """All ranks (the divergence check is everyone's decision); rank 0 writes the
        state, the position and ``partial_sums``: the epoch's metric sums so far over every
        rank (zeros at an epoch's end). Never after the input changed under the run."""
        if self.pipeline is not None:
            self.pipeline.check_unchanged(f"by step {self.global_step}")
        self.sync_state()
        self.check_weights()
        self.check_agreement()
        self.rank0_writes(
            self.checkpoints.save,
            progress,
            partial_sums,
            self.state,
            self.global_batch,
            self.global_step,
            self.record(),
            self.last_record and self.last_record.as_dict(),
        )

    @timings.timed("checkpoints")
    def commit(self, progress: Progress, partial_sums) -> None:
        """Elastic: remember this step in memory; may raise Horovod's hosts-updated interrupt."""
        self.sync_state()
        progress.sums = list(partial_sums)
        progress.last_record = None if self.last_record is None else self.last_record.as_dict()
        progress.commit()

    def check_weights(self) -> None:
        """Every rank holds the same weights, so every rank decides the same here: a
        checkpoint of NaN weights would make the "last good" one useless."""
        if not self.config.stop_on_divergence:
            return
        assert self.model is not None  # restore() set it before any save
        if not all(np.isfinite(v.numpy()).all() for v in self.model.trainable_variables):
            raise self.diverged(f"the weights became NaN or infinite by step {self.global_step}")

    def check_agreement(self) -> None:
        """All ranks, before each checkpoint: the ranks hold one model (weights and layers'
        state). Synchronous updates keep them so; a variable a train_step or callback
        updates by hand on each rank alone does not, and rank 0's checkpoint would then
        speak for N different models."""
        if self.world.size == 1:
            return
        differ = weights_agreement(self.world, self.model)["differ"]
        if differ:
            raise RanksDiffer(
                f"{ranks_differ_line(differ, self.global_step, self.front.fit)}; "
                f"training stopped ({self._kept()})"
            )

    def _kept(self) -> str:
        newest = self.checkpoints.steps()
        return (
            f"the newest checkpoint, from before it, is step {newest[0]} in {self.dir.checkpoints}"
            if newest
            else "no checkpoint was saved before it"
        )

    def diverged(self, what: str) -> Diverged:
        kept = self._kept()
        return Diverged(f"{what}: training stopped ({kept}); {self.front.diverged_advice}")

    @timings.timed("results")
    def epoch_end(self, record: EpochRecord) -> None:
        """All ranks. An epoch's record: metrics.jsonl and TensorBoard (rank 0); kept for
        checkpoints. With a tf.data input, the share of the epoch spent waiting for it."""
        if self.pipeline is not None:
            record.input_wait = share = self.pipeline.wait_share(record.seconds)
            if share > INPUT_BOUND and not self._said_input_bound:
                self._said_input_bound = True
                self.out.notice(
                    f"hvdtrain: input-bound: epoch {record.epoch}'s steps waited "
                    f"for input {share:.0%} of its time (slowest rank); parallel "
                    "map/interleave, prefetch or cache would speed it up"
                )
        self.last_record = record
        self.rank0_writes(self.out.epoch, record.as_dict())

    def use_record(self, record: EpochRecord) -> None:
        """The epoch whose weights the model ends with (EarlyStopping's best): its final_*."""
        self.last_record = record

    # --- after training -----------------------------------------------------------------------
    def finish(self, result: dict, model) -> dict:
        """result.json: the common fields, the driver's ``result``, every rank's weights
        compared, and model.keras (unless ``save_model`` is off). All ranks."""
        last = self.last_record.metrics if self.last_record else {}
        out = {
            "task": self.name,
            "backend": self.world.backend,
            "world_size": self.world.size,
            "global_step": self.global_step,
            "epochs": self.config.epochs,
            "keras": compat.describe(),
            **{f"final_{k}": v for k, v in last.items()},
            # the rate the optimizer applied (``learning_rate``: its name before)
            "applied_learning_rate": self.learning_rate,
            "learning_rate": self.learning_rate,
            **result,
        }
        scale = precision.loss_scale(self.optimizer)
        if scale is not None:  # float16: the scale the run ended with (the same on every rank)
            out["loss_scale"] = scale
        with timings.phase("results"):
            self.sync_state()  # the driver synced before evaluating; a no-op unless it did not
            agreed = weights_agreement(self.world, model)
            differ = agreed.pop("differ")
            out.update(agreed)
        if self.config.save_model:
            with timings.phase("model_save"):
                out["model"] = self.rank0_writes(self.out.save_model, model)
        with timings.phase("results"):
            out["timings"] = timings.report()  # rank 0's goes into the file
            self.rank0_writes(self.out.result, out)
        self.out.print(timings.line(out["timings"]), level=2)
        if differ:  # the work is kept (result.json says so), and the run fails
            raise RanksDiffer(
                f"{ranks_differ_line(differ, self.global_step, self.front.fit)}; "
                f"result.json and the model hold rank 0's "
                f"(ranks_identical: false)"
            )
        return out
