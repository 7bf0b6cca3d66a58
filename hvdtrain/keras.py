"""hvdtrain for ``model.compile`` / ``model.fit`` scripts: a few changed lines, same guarantees.

    import hvdtrain.keras as hk
    hk.init()                                          # Horovod, one device/thread pool per rank
    train = hk.dataset(x_train, y_train, batch_size=128, seed=0)     # this rank's batches
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hk.size())),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    try:
        hk.fit(model, train, epochs=5, validation_data=(x_test, y_test), run_dir="runs/fit")
    except hk.Preempted:
        sys.exit(hk.EXIT_PREEMPTED)                    # 75: rerun the same command to resume

``hk.fit`` calls ``model.fit`` (twice when resuming inside an epoch: once for the rest of
that epoch, once for the others) with ``steps_per_epoch`` fixed and a callback that adds:
gradients averaged by the optimizer; rank 0's state (initial or restored from its newest
checkpoint) broadcast before the first step; epoch metrics and validation metrics that are
exact over all ranks (the metrics' state variables summed over ranks; the validation set is
split so each example is scored by one rank); rank-0 checkpoints with the data position; a
SIGTERM on any rank stopping every rank after the same step (checkpoint, then ``Preempted``);
the dead/frozen-rank watchdog; and the run directory (config.json, metrics.jsonl,
tensorboard/, checkpoints/, result.json, model.keras). Only rank 0 prints: Keras' progress
bar on a terminal, one line per epoch in a pipe.

Keras 3 with ``jit_compile=True`` (or "auto" resolving to it on a GPU): Horovod's ops have
no XLA kernels in this build, so ``fit`` turns it off and says so in one line on rank 0.
Metrics must keep sums as state (Mean, accuracy, AUC, ... do), or their global value is wrong.
"""
from __future__ import annotations

import signal
import time

import numpy as np

from hvdtrain import checkpoint, compat, distributed
from hvdtrain.data import epoch_plan, steps_per_epoch, test_shard
from hvdtrain.optimizer import DistributedOptimizer  # noqa: F401 (public here)
from hvdtrain.config import ConfigError
from hvdtrain.report import Reporter, RunDirBusy, weights_agreement
from hvdtrain.train import EXIT_PREEMPTED, Preempted  # noqa: F401 (public here)
from hvdtrain.watchdog import Watchdog


# Steps between two checks for a SIGTERM on any rank. Every step (a host allreduce per step)
# halved fit's throughput against Horovod's own Keras wrapper; every 10 steps costs about
# nothing and delays a stop by at most 9 steps.
STOP_CHECK_EVERY = 10


def init(backend: str = "auto") -> distributed.World:
    """Start Horovod (or one process), pin devices and thread pools; return the World."""
    return distributed.init(backend)


def size() -> int:
    return distributed.current().size


def rank() -> int:
    return distributed.current().rank


class Dataset:
    """This rank's batches in hvdtrain's order (``data.epoch_plan``): one permutation of all
    examples per (seed, epoch); global step k takes the k-th block of ``batch_size * size``
    examples, rank r its r-th slice. ``batch_size=None``: each rank's whole shard per step."""

    def __init__(self, x, y, batch_size, seed, shuffle, world):
        self.x, self.y, self.seed, self.shuffle, self.world = x, y, seed, shuffle, world
        self.batch_size = batch_size or len(x) // world.size
        self.steps = steps_per_epoch(len(x), self.batch_size, world.size)
        if self.steps < 1:
            raise ValueError(f"batch_size {self.batch_size} x {world.size} ranks needs more "
                             f"than the {len(x)} examples")

    def batches(self, first_epoch: int, end_epoch: int, first_step: int = 0):
        """A tf.data.Dataset of this rank's batches from (first_epoch, first_step) to the end."""
        import tensorflow as tf

        w = self.world
        idx = np.concatenate([epoch_plan(len(self.x), self.batch_size, w.rank, w.size, self.seed,
                                         e, self.shuffle)[first_step if e == first_epoch else 0:]
                              for e in range(first_epoch, end_epoch)])
        x, y = tf.constant(self.x), tf.constant(self.y)
        return (tf.data.Dataset.from_tensor_slices(idx)
                .map(lambda i: (tf.gather(x, i), tf.gather(y, i))).prefetch(2))


def dataset(x, y, batch_size=None, seed: int = 0, shuffle: bool = True) -> Dataset:
    return Dataset(np.asarray(x), np.asarray(y), batch_size, seed, shuffle, distributed.current())


def fit(model, train: Dataset, epochs: int, validation_data=None, run_dir: str = "runs/fit",
        callbacks=(), checkpoint_every: int = 0, keep_checkpoints: int = 3,
        peer_timeout: float = 60.0, verbose: int = 1, validation_batch_size: int = 256):
    """``model.fit`` on every rank from rank 0's state or its newest checkpoint in
    ``run_dir``; returns the History (all ranks). Raises Preempted after a SIGTERM."""
    world = distributed.current()
    dog = Watchdog(world, peer_timeout).start()  # no rank waits forever for a dead peer
    run = _Fit(model, train, epochs, validation_data, run_dir, checkpoint_every,
               keep_checkpoints, verbose, dog)
    previous = signal.signal(signal.SIGTERM, run.on_sigterm)
    try:
        history = run.fit(list(callbacks), validation_batch_size)
    except (Preempted, distributed.RankError, checkpoint.CheckpointError, ConfigError):
        dog.close()  # every rank raised it together
        raise
    except BaseException as e:
        dog.abort(f"{type(e).__name__}: {e}")  # this rank alone: stop the others too
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    dog.close()
    return history


def _metric_variables(model) -> list:
    seen, found = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                found.append(v)
    return found


class _Fit:
    def __init__(self, model, train, epochs, validation_data, run_dir, checkpoint_every,
                 keep, verbose, dog):
        self.model, self.train, self.epochs, self.dog = model, train, epochs, dog
        self.world, self.keep, self.checkpoint_every = train.world, keep, checkpoint_every
        self.validation_data = validation_data
        self.out = Reporter(self.world, run_dir, "fit", verbose)
        self.ckpt_dir = self.out.run_dir + "/checkpoints"
        self.global_batch = train.batch_size * self.world.size
        self.settings = {"global_batch": self.global_batch, "seed": train.seed,
                         "shuffle": train.shuffle, "train_examples": len(train.x)}
        self.stop_requested = self.stop_pending = False
        self.last_record = None

    def on_sigterm(self, signum, frame):
        self.stop_requested = True

    # --- before model.fit: build, restore, broadcast ------------------------------------------
    def _prepare(self) -> dict:
        model, world = self.model, self.world
        if compat.is_keras3() and model.jit_compile:
            self.out.notice("hvdtrain: jit_compile turned off: Horovod's ops have no XLA kernels")
            model.jit_compile = False  # the setter drops any traced train function
        if not model.built:
            model(self.train.x[:1])
        # Create the optimizer's slots now, so that one broadcast covers the whole state.
        model.optimizer.build(model.trainable_variables)
        self.state = list(model.variables) + list(model.optimizer.variables)
        found = world.agree(lambda: self._find() if world.is_chief else None,
                            catch=(checkpoint.CheckpointError,))
        progress = {"epoch": 0, "step": 0, "sums": None, "last_record": None, "path": None}
        if found is not None:
            meta, arrays, path = found
            for variable, value in zip(self.state, arrays):
                variable.assign(value)
            progress = {"epoch": meta["epoch"], "step": meta["step_in_epoch"],
                        "sums": arrays[-1], "last_record": meta["last_record"], "path": path}
        progress = world.broadcast_object(progress)
        # Horovod: every rank starts from rank 0's state, initial or restored.
        world.broadcast_variables(self.state)
        return progress

    def _find(self):
        """Rank 0: the newest valid checkpoint, if it matches this run."""
        found = checkpoint.load_latest(self.ckpt_dir, self.out.notice)
        if found is None:
            return None
        meta, arrays, path = found
        changed = {k: (meta["run"].get(k), v) for k, v in self.settings.items()
                   if meta["run"].get(k) != v}
        if changed or len(arrays) != len(self.state) + 1 or any(
                tuple(a.shape) != tuple(v.shape) for a, v in zip(arrays, self.state)):
            what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "the model"
            raise checkpoint.CheckpointError(f"{path} was made by another run ({what}): use the "
                                             "same settings, or another run_dir")
        return found

    # --- model.fit ----------------------------------------------------------------------------
    def fit(self, callbacks, validation_batch_size):
        # As for a Task run: a file in its place, no permission or a finished run in it is
        # refused before anything else; rank 0 then holds the directory (a second run on it
        # is refused while this one lives).
        problem = self.world.broadcast_object(self.out.problem())
        if problem:
            raise ConfigError("run_dir", self.out.run_dir, problem)
        self.world.agree(self.out.claim, catch=(RunDirBusy, OSError))
        try:
            return self._fit(callbacks, validation_batch_size)
        finally:
            self.out.release()

    def _fit(self, callbacks, validation_batch_size):
        keras, world, train = compat.keras(), self.world, self.train
        progress = self._prepare()
        start, first = progress["epoch"], progress["step"]
        self.saved_sums, self.last_record = progress["sums"], progress["last_record"]
        self.global_step = int(self.model.optimizer.iterations.numpy())
        if self.global_step:
            self.out.notice(f"hvdtrain: resumed from {progress['path']} at epoch {start + 1}, "
                            f"step {self.global_step}")
        self.out.start({**self.settings, "epochs": self.epochs, "world_size": world.size,
                        "backend": world.backend, "batch_size": train.batch_size,
                        "keras": compat.describe()}, completed_epochs=start)
        val = None
        if self.validation_data is not None:
            x, y = self.validation_data
            part = test_shard(len(x), world.rank, world.size)  # each example on one rank
            val = (np.asarray(x)[part], np.asarray(y)[part])
        callback = _callback(keras, self)
        shown = self.out.verbose if self.out.interactive else 0  # rank 0, on a terminal
        histories = []
        # Resuming inside an epoch: one call for its remaining steps, then the others.
        for e0, e1, skip in ((start, start + 1, first), (start + 1, self.epochs, 0)) if first \
                else ((start, self.epochs, 0),):
            if e1 <= e0:
                continue
            self.first_step = skip
            histories.append(self.model.fit(
                train.batches(e0, e1, skip), epochs=e1, initial_epoch=e0,
                steps_per_epoch=train.steps - skip, validation_data=val,
                validation_batch_size=validation_batch_size, callbacks=[callback] + callbacks,
                shuffle=False, verbose=shown))  # the order is the Dataset's
        self._finish()
        history = histories[-1] if histories else keras.callbacks.History()
        for h in histories[:-1]:  # one History for the whole run
            history.epoch = h.epoch + history.epoch
            for k, v in h.history.items():
                history.history[k] = v + history.history.get(k, [])
        return history

    # --- the callback's work --------------------------------------------------------------------
    def epoch_begin(self, epoch):
        self.epoch, self.step, self.started = epoch, self.first_step, self.first_step
        self.first_step, self.tick = 0, time.perf_counter()

    def batch_end(self, logs):
        world = self.world
        if self.saved_sums is not None:  # first step after a mid-epoch resume: the saved part
            if world.is_chief:  # of the epoch's metric sums (already over all ranks)
                self._add_sums(self.saved_sums)
            self.saved_sums = None
        self.step += 1
        self.global_step += 1
        self.dog.step = self.global_step
        last = self.step == self.train.steps
        # Horovod: a one-number allreduce makes any rank's SIGTERM every rank's decision at
        # the same step. It is a host round trip of its own, so it is taken every
        # STOP_CHECK_EVERY steps (and at each epoch's end): all ranks count the same steps.
        stop = (self.step % STOP_CHECK_EVERY == 0 or last) and \
            world.allreduce_sum([float(self.stop_requested)])[0] > 0
        if last:
            self.train_logs = self._reduce_metrics()  # before validation resets the metrics
            if logs is not None:
                logs.update(self.train_logs)
        if stop and last:
            self.stop_pending = True  # the epoch's end saves; stop there
        elif stop:
            self._save(self.epoch, self.step, self._summed())
            world.barrier()  # nobody exits (and gets the job killed) before the save
            raise Preempted(f"stopped by SIGTERM at step {self.global_step}; checkpoint saved "
                            f"in {self.ckpt_dir}; run the same command to resume")
        elif not last and self.checkpoint_every and self.global_step % self.checkpoint_every == 0:
            self._save(self.epoch, self.step, self._summed())

    def test_end(self, logs):
        self.val_logs = self._reduce_metrics()
        if logs is not None:
            logs.update(self.val_logs)

    def epoch_end(self, epoch, logs):
        logs.update(self.train_logs)  # Keras 2 built its dict before the reduction
        if self.validation_data is not None:
            logs.update({f"val_{k}": v for k, v in self.val_logs.items()})
        seconds = time.perf_counter() - self.tick
        self.last_record = record = {
            "epoch": epoch + 1, "epochs": self.epochs, "global_step": self.global_step,
            **{k: float(v) for k, v in logs.items() if np.ndim(v) == 0},
            "samples_per_sec": (self.train.steps - self.started) * self.global_batch / seconds,
            "seconds": seconds, "world_size": self.world.size}
        self.out.epoch(record)
        self._save(epoch + 1, 0, None)
        if not self.out.interactive:
            self.out.print(f"Epoch {epoch + 1}/{self.epochs} - " + " - ".join(
                f"{k}: {record[k]:.4f}" for k in logs if k in record and k != "lr")
                + f" - {record['samples_per_sec']:,.0f} samples/s")
        if self.stop_pending:
            self.world.barrier()
            raise Preempted(f"stopped by SIGTERM at step {self.global_step}; checkpoint saved "
                            f"in {self.ckpt_dir}; run the same command to resume")

    # --- metrics and checkpoints ------------------------------------------------------------------
    def _flat_metrics(self):
        return np.concatenate([np.ravel(v.numpy()).astype(np.float64)
                               for v in _metric_variables(self.model)] or [np.zeros(0)])

    def _summed(self) -> np.ndarray:
        """All ranks: the metric state so far, summed over ranks (what a checkpoint keeps)."""
        return self.world.allreduce_sum(self._flat_metrics())

    def _add_sums(self, flat) -> None:
        at = 0
        for v in _metric_variables(self.model):
            n = int(np.prod(v.shape))
            now = np.asarray(v.numpy())
            v.assign(now + flat[at:at + n].reshape(now.shape).astype(now.dtype))
            at += n

    def _reduce_metrics(self) -> dict:
        """All ranks: put the sum over ranks into every metric variable; return the results."""
        total = self._summed()
        for v in _metric_variables(self.model):
            v.assign(np.zeros_like(v.numpy()))
        self._add_sums(total)
        return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def _save(self, epoch, step, sums) -> None:
        """Rank 0 writes model + optimizer variables, the position and the metric sums."""
        if not self.world.is_chief:
            return
        meta = {"epoch": epoch, "step_in_epoch": step, "offset": step * self.global_batch,
                "global_batch": self.global_batch, "global_step": self.global_step,
                "world_size": self.world.size, "run": self.settings, "time": time.time(),
                "last_record": self.last_record}
        sums = np.zeros(0) if sums is None else np.asarray(sums)
        arrays = [np.asarray(v.numpy()) for v in self.state] + [sums]
        names = [compat.variable_name(v) for v in self.state] + ["metric_sums"]
        checkpoint.save(self.ckpt_dir, arrays, names, meta, self.keep)

    def _finish(self) -> None:
        """result.json with a cross-rank weight digest; model.keras (rank 0)."""
        last = self.last_record or {}
        result = {
            "world_size": self.world.size, "backend": self.world.backend,
            "keras": compat.describe(), "epochs": self.epochs,
            "global_step": self.global_step, "batch_size": self.train.batch_size,
            "global_batch_size": self.global_batch, "train_examples": len(self.train.x),
            **{f"final_{k}": v for k, v in last.items() if k not in (
                "epoch", "epochs", "global_step", "samples_per_sec", "seconds", "world_size")},
            **weights_agreement(self.world, self.model)}
        result["model"] = self.out.save_model(self.model)
        self.out.result(result)


def _callback(keras, run: _Fit):
    """The Keras callback (of the Keras in use) that hands fit's events to ``run``."""

    class HorovodFit(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            run.epoch_begin(epoch)

        def on_train_batch_end(self, batch, logs=None):
            run.batch_end(logs)

        def on_test_end(self, logs=None):
            run.test_end(logs)

        def on_epoch_end(self, epoch, logs=None):
            run.epoch_end(epoch, logs)

    return HorovodFit()


__all__ = ["DistributedOptimizer", "EXIT_PREEMPTED", "Preempted", "STOP_CHECK_EVERY", "dataset",
           "fit", "init", "rank", "size"]
