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
same run engine (``hvdtrain.engine``), so it keeps the same promises: gradients averaged by the
optimizer; rank 0's state (initial or restored from its newest checkpoint) broadcast before
the first step; epoch and validation metrics exact over all ranks; rank-0 checkpoints with
the data position; a SIGTERM on any rank stopping every rank after the same step
(checkpoint, then ``Preempted``); NaN or infinite weights or loss stopping every rank
(``Diverged``); the dead/frozen-rank watchdog; and the same run directory (config.json,
metrics.jsonl, tensorboard/, checkpoints/, result.json, model.keras). Only rank 0 prints:
Keras' progress bar on a terminal, one line per epoch in a pipe. The driver is ``hvdtrain.fit``.

``hk.fit`` also takes a ``tf.data.Dataset`` of per-rank batches, sharded, counted and
resumed by hvdtrain (``hvdtrain.inputs.pipeline``; docs/guides/data.md).

Keras 3 with ``jit_compile=True`` (or "auto" resolving to it on a GPU): Horovod's ops have
no XLA kernels in this build, so ``fit`` turns it off and says so in one line on rank 0.
Metrics must keep sums as state (Mean, accuracy, AUC, ... do), or their global value is wrong.

Mixed precision: set Keras' policy in the script before building the model
(``keras.mixed_precision.set_global_policy("mixed_bfloat16")``); under ``mixed_float16``
the loss scaler that ``compile`` adds is composed with the distributed optimizer so that it
sees the reduced gradients (docs/guides/mixed-precision.md).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from hvdtrain import datasets, distributed  # noqa: F401 (datasets: public)
from hvdtrain.base import timings
from hvdtrain.base.config import Config
from hvdtrain.base.errors import (EXIT_PREEMPTED, ConfigError, DataError, Diverged,  # noqa: F401
                                  Error, Preempted)
from hvdtrain.distributed.optimizer import DistributedOptimizer  # noqa: F401 (public here)
from hvdtrain.engine.fronts import FIT_SCRIPT
from hvdtrain.engine.run import Run
from hvdtrain.fit.chief import on_chief  # noqa: F401 (public here)
from hvdtrain.fit.driver import STOP_CHECK_EVERY, FitRun
from hvdtrain.fit.script import FitSettings, fit_config, user_callbacks
from hvdtrain.inputs import nest, pipeline, sources  # noqa: F401 (pipeline: hk.pipeline)
from hvdtrain.inputs.data import epoch_plan, steps_per_epoch
from hvdtrain.inputs.pipeline import Batches
from hvdtrain.inputs.sources import is_dataset

# Config's defaults: hk.fit's keyword arguments that are Config's fields default to them.
_DEFAULT = {f.name: f.default for f in dataclasses.fields(Config)}


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
    examples, rank r its r-th slice. ``batch_size=None``: each rank's whole shard per step.

    ``x``, ``y`` and ``sample_weight`` are arrays or what ``model.fit`` takes besides: dicts
    (by input or output name), tuples and lists of arrays, nested; every array holds the same
    examples along its first axis (``hvdtrain.inputs.nest``)."""

    def __init__(self, x, y, batch_size, seed, shuffle, world, sample_weight=None):
        self.x, self.y, self.seed, self.shuffle, self.world = x, y, seed, shuffle, world
        self.sample_weight = sample_weight
        parts = (("x", x), ("y", y)) + ((("sample_weight", sample_weight),)
                                        if sample_weight is not None else ())
        n = nest.examples("hk.dataset", parts)
        if batch_size is not None and batch_size < 0:
            raise ConfigError("batch_size", batch_size, "must be 0 or None (each rank's whole "
                              "shard per step) or more")
        self.batch_size = batch_size or n // world.size
        self.steps = steps_per_epoch(n, self.batch_size, world.size)
        if self.steps < 1:
            raise ConfigError("batch_size", self.batch_size, f"a global batch of "
                              f"{self.batch_size} x {world.size} ranks needs more than the "
                              f"{n} examples")
        self.examples, self.sample = n, nest.take(x, slice(0, 1))

    def info(self) -> dict:
        return {"train_examples": self.examples}

    def batches(self, first_epoch: int, end_epoch: int, first_step: int = 0):
        """A tf.data.Dataset of this rank's batches from (first_epoch, first_step) to the end."""
        import tensorflow as tf

        w = self.world
        idx = np.concatenate([epoch_plan(self.examples, self.batch_size, w.rank, w.size,
                                         self.seed, e, self.shuffle)
                              [first_step if e == first_epoch else 0:]
                              for e in range(first_epoch, end_epoch)])
        parts = tuple(nest.map(tf.constant, p) for p in (self.x, self.y, self.sample_weight)
                      if p is not None)
        # tf.data's default rewrites serialize the pipeline's graph with the arrays the map
        # captures (0.3-0.7 s for Fashion-MNIST's 188 MB) for nothing a gather needs: off,
        # as Keras' own array adapter has them.
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = False
        return (tf.data.Dataset.from_tensor_slices(idx)
                .map(lambda i: tuple(nest.map(lambda a: tf.gather(a, i), p) for p in parts))
                .prefetch(2).with_options(options))


def adapt(layer, data, **kwargs):
    """``layer.adapt(data, **kwargs)`` on rank 0, and every rank given rank 0's state: its
    vocabulary (TextVectorization, StringLookup, IntegerLookup: ``set_vocabulary``), its
    adapted variables (Normalization's mean and variance) and the arrays, tensors and lists
    of floats it keeps outside them (``preflight.state_attributes``: Normalization's mean
    and variance tensors, Discretization's bin boundaries). Each rank adapting on its own
    shard would give each rank another model; hk.fit refuses that before the first step.
    All ranks; returns ``layer``."""
    from hvdtrain.base.errors import TaskError, user_code
    from hvdtrain.engine.preflight import state_attributes

    world = distributed.current()

    def on_rank0():
        if not world.is_chief:
            return None
        with user_code(f"hk.adapt: {type(layer).__name__}.adapt"):
            layer.adapt(data, **kwargs)
        vocabulary = getattr(layer, "get_vocabulary", None)
        if vocabulary is not None:
            return {"vocabulary": list(vocabulary())}
        build = getattr(layer, "get_build_config", lambda: None)()
        return {"build": build, "variables": [np.asarray(v.numpy()) for v in layer.variables],
                "attributes": {k: (_kind(v), np.asarray(v))
                               for k, v in state_attributes(layer).items()}}

    state = world.broadcast_object(world.agree(on_rank0, catch=(TaskError,), merge=TaskError))
    if world.is_chief:
        return layer
    if "vocabulary" in state:
        layer.set_vocabulary(state["vocabulary"])
        return layer
    import tensorflow as tf

    if not layer.built and state["build"]:
        layer.build_from_config(state["build"])
    for variable, value in zip(layer.variables, state["variables"]):
        variable.assign(value)
    for name, (kind, value) in state["attributes"].items():
        setattr(layer, name, {"tensor": tf.constant, "list": list}.get(kind, np.asarray)(value))
    return layer


def _kind(value) -> str:
    return ("tensor" if type(value).__name__ == "EagerTensor" else
            "array" if isinstance(value, np.ndarray) else "list")


def files(pattern: str) -> list:
    """The files matching ``pattern``, sorted: the same list on every rank, for a tf.data
    pipeline that hvdtrain shards by file. One line (every rank) when none matches."""
    return sources.files(pattern, distributed.current())


@timings.timed("data")
def dataset(x, y, batch_size=None, seed: int = 0, shuffle: bool = True,
            sample_weight=None) -> Dataset:
    """This rank's batches of (x, y) or (x, y, sample_weight): arrays, or dicts, tuples and
    lists of them as ``model.fit`` takes them (see ``Dataset``)."""
    try:
        return Dataset(nest.arrays(x), nest.arrays(y), batch_size, seed, shuffle,
                       distributed.current(),
                       None if sample_weight is None else nest.arrays(sample_weight))
    except ConfigError as e:
        raise e.in_call("hk.dataset") from None


def fit(model, train, epochs: int, validation_data=None, *, callbacks=(),
        validation_batch_size: int = 256, steps_per_epoch: int = None, sharded: bool = False,
        run_dir: Optional[str] = _DEFAULT["run_dir"],
        checkpoint_every: int = _DEFAULT["checkpoint_every"],
        keep_checkpoints: int = _DEFAULT["keep_checkpoints"],
        resume: Optional[bool] = _DEFAULT["resume"], **settings):
    """``model.fit`` on every rank from rank 0's state or its newest checkpoint in
    ``run_dir``; returns the History (all ranks).

    ``train``: ``hk.dataset(x, y, ...)``, or a ``tf.data.Dataset`` of this rank's batches
    built as for one process ((x, y) or (x, y, sample_weight), Horovod's per-rank batch
    size), which hvdtrain shards (by file, else by batch; ``sharded=True``: the user did)
    and counts (every rank takes the fewest steps any rank has, or ``steps_per_epoch``,
    required for a dataset that repeats forever): ``hvdtrain.inputs.pipeline``. ``validation_data``:
    (x, y) or (x, y, sample_weight) of arrays (or dicts, tuples, lists of them, as the
    training data), or a ``tf.data.Dataset`` of batches, each example scored by one rank.

    A ``run_dir`` holding a finished run of at least ``epochs`` epochs with the same settings
    (the same script run again) trains nothing and rewrites nothing: the model gets the run's
    final state, and the History is the run's. Each hk.fit of one script (two phases of
    transfer learning) needs its own ``run_dir``.

    ``run_dir``: where rank 0 writes the run (None: ``runs/fit-<time>``); ``checkpoint_every``
    (updates between checkpoints; 0: at epoch ends only), ``keep_checkpoints``, ``resume``
    (None: resume from the newest checkpoint if there is one; True: require one; False:
    refuse a run_dir that holds checkpoints): ``hvdtrain.Config``'s fields of those names.
    ``settings``: Config's other fields that a fit script may set, by the same names and with
    the same defaults (``peer_timeout=30``, ``stop_on_divergence``, ``save_model``,
    ``verbose``, ...); those the model, the optimizer or the dataset decide are refused
    (``Config``'s ``fit_refusal``).
    Raises an ``hk.Error`` (``hvdtrain.base.errors.Error``: one line; ``Preempted`` after a
    SIGTERM: rerun the same command to resume).
    """
    settings = dict(run_dir=run_dir, checkpoint_every=checkpoint_every,
                    keep_checkpoints=keep_checkpoints, resume=resume, **settings)
    with timings.phase("other"):  # the run: what no named phase inside claims
        try:
            return _fit(model, train, epochs, validation_data, callbacks,
                        validation_batch_size, steps_per_epoch, sharded, settings)
        except ConfigError as e:  # named as the script wrote it: hk.fit(epochs=0)
            raise e.in_call("hk.fit") from None


def _fit(model, train, epochs, validation_data, callbacks, validation_batch_size,
         steps_per_epoch, sharded, settings):
    if is_dataset(train):
        with timings.phase("data"):
            train = Batches(train, distributed.current(), sharded, steps_per_epoch)
        source = "tf.data " + train.policy
    elif steps_per_epoch is not None or sharded:
        raise ConfigError("steps_per_epoch" if steps_per_epoch is not None else "sharded",
                          steps_per_epoch if steps_per_epoch is not None else sharded,
                          "for a tf.data.Dataset only (hk.dataset counts its own steps)")
    else:
        source = "arrays"
    world = train.world
    config = fit_config(model, train, epochs, world, **settings)
    callbacks = user_callbacks(list(callbacks), world)  # some write files: rank 0's alone
    fit_settings = FitSettings(train.shuffle, train.examples, source, steps_per_epoch or 0)
    with Run(world, config, FIT_SCRIPT, fit_settings) as run:
        return FitRun(model, train, validation_data, run, sharded).fit(list(callbacks),
                                                                     validation_batch_size)


def report_error(e: Error, prog: str = None) -> int:
    """Say ``e`` in one line on stderr (once, by rank 0, when every rank raised it) and return
    its exit status: what a fit script does with an ``hvdtrain.keras.Error``."""
    import os
    import sys

    from hvdtrain.cli import report

    return report(prog or os.path.basename(sys.argv[0]), e)


__all__ = ["DistributedOptimizer", "adapt", "datasets", "Diverged", "EXIT_PREEMPTED", "Error", "Preempted",
           "STOP_CHECK_EVERY", "dataset", "files", "fit", "init", "on_chief", "rank", "report_error", "size"]
