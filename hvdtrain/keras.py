"""hvdtrain for ``model.compile`` / ``model.fit`` scripts: a few changed lines, same guarantees.

    import hvdtrain.keras as hk
    hk.init()                                          # Horovod, one device/thread pool per rank
    train = hk.dataset(x_train, y_train, batch_size=128, seed=0)     # this rank's batches
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hk.size())),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    try:
        hk.fit(model, train, epochs=5, validation_data=(x_test, y_test), run_dir="runs/fit")
    except hk.Error as e:                              # one line; 75 after SIGTERM: rerun
        sys.exit(hk.report_error(e))                   # the same command to resume

``hk.fit`` takes the Task path's settings by the same names and with the same defaults
(``run_dir``, ``checkpoint_every``, ``keep_checkpoints``, ``resume``, ``peer_timeout``,
``stop_on_divergence``, ``save_model``, ``verbose``: ``hvdtrain.Config``) and runs on the
same run engine (``engine.py``), so it keeps the same promises: gradients averaged by the
optimizer; rank 0's state (initial or restored from its newest checkpoint) broadcast before
the first step; epoch and validation metrics exact over all ranks; rank-0 checkpoints with
the data position; a SIGTERM on any rank stopping every rank after the same step
(checkpoint, then ``Preempted``); NaN or infinite weights or loss stopping every rank
(``Diverged``); the dead/frozen-rank watchdog; and the same run directory (config.json,
metrics.jsonl, tensorboard/, checkpoints/, result.json, model.keras). Only rank 0 prints:
Keras' progress bar on a terminal, one line per epoch in a pipe. The driver is ``fit.py``.

Keras 3 with ``jit_compile=True`` (or "auto" resolving to it on a GPU): Horovod's ops have
no XLA kernels in this build, so ``fit`` turns it off and says so in one line on rank 0.
Metrics must keep sums as state (Mean, accuracy, AUC, ... do), or their global value is wrong.
"""
from __future__ import annotations

import numpy as np

from hvdtrain import distributed
from hvdtrain.data import epoch_plan, steps_per_epoch
from hvdtrain.engine import Run
from hvdtrain.errors import (EXIT_PREEMPTED, ConfigError, DataError, Diverged,  # noqa: F401
                             Error, Preempted)
from hvdtrain.fit import STOP_CHECK_EVERY, FitSettings, _Fit, fit_config, user_callbacks
from hvdtrain.optimizer import DistributedOptimizer  # noqa: F401 (public here)


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
        if len(x) != len(y):
            raise DataError(f"hk.dataset: x has {len(x)} examples but y has {len(y)}")
        if batch_size is not None and batch_size < 0:
            raise ConfigError("batch_size", batch_size, "must be 0 or None (each rank's whole "
                              "shard per step) or more")
        self.batch_size = batch_size or len(x) // world.size
        self.steps = steps_per_epoch(len(x), self.batch_size, world.size)
        if self.steps < 1:
            raise ConfigError("batch_size", self.batch_size, f"a global batch of "
                              f"{self.batch_size} x {world.size} ranks needs more than the "
                              f"{len(x)} examples")

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


def fit(model, train: Dataset, epochs: int, validation_data=None, *, callbacks=(),
        validation_batch_size: int = 256, **settings):
    """``model.fit`` on every rank from rank 0's state or its newest checkpoint in
    ``run_dir``; returns the History (all ranks).

    ``settings``: ``hvdtrain.Config``'s fields, by the same names and with the same defaults
    (``run_dir=None`` is ``runs/fit-<time>``; ``checkpoint_every=100``; ``peer_timeout=30``).
    Raises an ``hvdtrain.errors.Error`` (one line; ``Preempted`` after a SIGTERM: rerun the
    same command to resume).
    """
    world = train.world
    config = fit_config(model, train, epochs, world, **settings)
    callbacks = user_callbacks(list(callbacks), world)  # some write files: rank 0's alone
    with Run(world, config, "fit", FitSettings(train.shuffle, len(train.x))) as run:
        return _Fit(model, train, validation_data, run).fit(list(callbacks),
                                                            validation_batch_size)


def report_error(e: Error, prog: str = None) -> int:
    """Say ``e`` in one line on stderr (once, by rank 0, when every rank raised it) and return
    its exit status: what a fit script does with an ``hvdtrain.keras.Error``."""
    import os
    import sys

    from hvdtrain.cli import report

    return report(prog or os.path.basename(sys.argv[0]), e)


__all__ = ["DistributedOptimizer", "Diverged", "EXIT_PREEMPTED", "Error", "Preempted",
           "STOP_CHECK_EVERY", "dataset", "fit", "init", "rank", "report_error", "size"]
