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

import importlib as _importlib
import typing as _typing
import warnings as _warnings

from hvdtrain import datasets
from hvdtrain import distributed as _distributed
from hvdtrain.base import timings as _timings
from hvdtrain.base.errors import ConfigError as _ConfigError
from hvdtrain.base.errors import Diverged, Error, Preempted
from hvdtrain.distributed.optimizer import DistributedOptimizer
from hvdtrain.fit.adapt import adapt_on_chief as _adapt_on_chief
from hvdtrain.fit.chief import on_chief
from hvdtrain.fit.entry import fit_model as _fit_model
from hvdtrain.inputs import nest as _nest
from hvdtrain.inputs import sources as _sources
from hvdtrain.inputs.arrays import ArrayBatches as _ArrayBatches

if _typing.TYPE_CHECKING:
    from hvdtrain import distributed


def _config_defaults() -> dict:
    import dataclasses

    from hvdtrain.base.config import Config

    return {f.name: f.default for f in dataclasses.fields(Config)}


# Config's defaults: hk.fit's keyword arguments that are Config's fields default to them.
_DEFAULT = _config_defaults()


def init(backend: str = "auto") -> "distributed.World":
    """Start Horovod (or one process), and pin this rank's devices and thread pools.

    Call it first, on every rank, before building the model.

    Args:
        backend: ``"auto"`` (Horovod if it is installed, else one process), ``"horovod"``
            (require it) or ``"single"`` (one process, no Horovod).

    Returns:
        The World: ``.rank``, ``.size``, ``.local_rank``, ``.local_size``, ``.is_chief``.

    Raises:
        Error: the processes cannot train together as launched (a launcher started several
            processes, or ``"horovod"`` was asked for, and Horovod cannot be imported).
    """
    return _distributed.init(backend)


def size() -> int:
    """The number of ranks (processes) in the job; 1 without a launcher.

    Returns:
        ``hk.init()``'s World's size (Horovod is started if ``hk.init`` was not called).
    """
    return _distributed.current().size


def rank() -> int:
    """This process's rank, from 0; rank 0 prints and writes the run directory.

    Returns:
        ``hk.init()``'s World's rank (Horovod is started if ``hk.init`` was not called).
    """
    return _distributed.current().rank


def adapt(layer, data, **kwargs):
    """Adapt a preprocessing layer on rank 0 and give every rank rank 0's state.

    Each rank adapting on its own shard would give each rank another model; ``hk.fit``
    refuses that before the first step. Call it on every rank.

    The state handed on: the vocabulary (TextVectorization, StringLookup, IntegerLookup:
    ``set_vocabulary``), the adapted variables (Normalization's mean and variance) and the
    arrays, tensors and lists of floats the layer keeps outside them (Normalization's mean
    and variance tensors, Discretization's bin boundaries).

    Args:
        layer: a Keras preprocessing layer.
        data: what ``layer.adapt`` takes (rank 0's is used).
        **kwargs: ``layer.adapt``'s other arguments.

    Returns:
        ``layer``, adapted, on every rank.

    Raises:
        TaskError: ``layer.adapt`` raised on rank 0 (every rank raises it).
    """
    return _adapt_on_chief(layer, data, _distributed.current(), kwargs)


def files(pattern: str) -> list:
    """The files matching a pattern, sorted: the same list on every rank.

    For a ``tf.data`` pipeline that ``hk.fit`` shards by file (see the data guide).

    Args:
        pattern: a glob pattern (``"data/train-*.tfrecord"``).

    Returns:
        The paths, sorted.

    Raises:
        DataError: no file matches on some rank (one line, on every rank).
    """
    return _sources.files(pattern, _distributed.current())


@_timings.timed("data")
def dataset(x, y, batch_size=None, seed: int = 0, shuffle: bool = True, sample_weight=None):
    """This rank's batches of ``(x, y)`` or ``(x, y, sample_weight)``, for ``hk.fit``.

    One permutation of all examples per (seed, epoch), the same on every rank: global step k
    takes the k-th block of ``batch_size * hk.size()`` examples, rank r its r-th slice. The
    examples that do not fill a global batch wait for another epoch. ``hk.fit`` resumes the
    order at the step of a checkpoint.

    Args:
        x: the inputs: an array, or dicts (by input name), tuples and lists of arrays,
            nested, as ``model.fit`` takes them; every array holds the same examples along
            its first axis.
        y: the labels, as ``x``.
        batch_size: examples per rank per step (Horovod's per-rank batch size); None or 0:
            each rank's whole shard per step.
        seed: the order's seed (the same on every rank).
        shuffle: False: the examples in their order.
        sample_weight: per-example weights, as ``y``, or None.

    Returns:
        This rank's batches, which ``hk.fit`` takes as ``train``.

    Raises:
        ConfigError: ``batch_size`` is negative, or a global batch needs more examples than
            there are.
        DataError: the arrays do not hold the same number of examples.
    """
    try:
        return _ArrayBatches(
            _nest.arrays(x),
            _nest.arrays(y),
            batch_size,
            seed,
            shuffle,
            _distributed.current(),
            None if sample_weight is None else _nest.arrays(sample_weight),
        )
    except _ConfigError as e:
        raise e.in_call("hk.dataset") from None


def fit(
    model,
    train,
    epochs: int,
    validation_data=None,
    *,
    callbacks=(),
    validation_batch_size: int = 256,
    steps_per_epoch: int = None,
    sharded: bool = False,
    run_dir: str | None = _DEFAULT["run_dir"],
    checkpoint_every: int = _DEFAULT["checkpoint_every"],
    keep_checkpoints: int = _DEFAULT["keep_checkpoints"],
    resume: bool | None = _DEFAULT["resume"],
    **settings,
):
    """``model.fit`` on every rank, from rank 0's state or the newest checkpoint in ``run_dir``.

    Call it on every rank. Gradients are averaged by the optimizer
    (``hk.DistributedOptimizer``); metrics are exact over all ranks; rank 0 writes the run
    directory and its checkpoints; a SIGTERM on any rank stops every rank after the same
    step. A ``run_dir`` holding a finished run of at least ``epochs`` epochs with the same
    settings (the same script run again) trains nothing and rewrites nothing: the model gets
    the run's final state, and the History is the run's. Each ``hk.fit`` of one script (two
    phases of transfer learning) needs its own ``run_dir``.

    Args:
        model: a compiled Keras model (its optimizer an ``hk.DistributedOptimizer``).
        train: ``hk.dataset(x, y, ...)``, or a ``tf.data.Dataset`` of this rank's batches
            built as for one process (``(x, y)`` or ``(x, y, sample_weight)``, Horovod's
            per-rank batch size), which hvdtrain shards (by file, else by batch) and counts
            (every rank takes the fewest steps any rank has).
        epochs: the epochs to train, in all (a resumed run trains those left).
        validation_data: ``(x, y)`` or ``(x, y, sample_weight)`` of arrays (or dicts,
            tuples, lists of them, as the training data), or a ``tf.data.Dataset`` of
            batches; each example is scored by one rank. None: no validation.
        callbacks: Keras callbacks; those that write files run on rank 0 only, and so do
            those wrapped in ``hk.on_chief`` and the trackers' own.
        validation_batch_size: the batch of arrays given as ``validation_data``.
        steps_per_epoch: for a ``tf.data.Dataset``: the steps of an epoch (required for one
            that repeats forever).
        sharded: for a ``tf.data.Dataset``: True when each rank's dataset is already its own
            shard, so hvdtrain does not shard it.
        run_dir: where rank 0 writes the run (None: ``runs/fit-<time>``).
        checkpoint_every: updates between checkpoints (0: at epoch ends only).
        keep_checkpoints: how many of the newest checkpoints to keep.
        resume: None: resume from the newest checkpoint if there is one; True: require one;
            False: refuse a ``run_dir`` that holds checkpoints.
        **settings: the other settings a fit script may set, by their names in
            ``hvdtrain.Config`` and with the same defaults (``peer_timeout=30``,
            ``stop_on_divergence``, ``save_model``, ``verbose``, ``track=["mlflow"]``
            for experiment trackers, ...); those that the model,
            the optimizer or the dataset decide are refused (the settings table says which).

    Returns:
        The Keras History, on every rank.

    Raises:
        Error: one line, with its exit status (``hk.report_error`` says it):
            ``ConfigError`` for a bad argument, ``Preempted`` after a SIGTERM (rerun the
            same command to resume), ``Diverged`` for a NaN or infinite loss, ...
    """
    settings = dict(
        run_dir=run_dir,
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        resume=resume,
        **settings,
    )
    with _timings.phase("other"):  # the run: what no named phase inside claims
        try:
            return _fit_model(
                model,
                train,
                epochs,
                validation_data,
                callbacks,
                validation_batch_size,
                steps_per_epoch,
                sharded,
                settings,
            )
        except _ConfigError as e:  # named as the script wrote it: hk.fit(epochs=0)
            raise e.in_call("hk.fit") from None


def report_error(e: Error, prog: str = None) -> int:
    """Say an error in one line on stderr and return its exit status.

    What a fit script does with an ``hk.Error``: ``sys.exit(hk.report_error(e))``. An error
    that every rank raised is said once, by rank 0.

    Args:
        e: the error.
        prog: the program's name that starts the line (default: the script's file name).

    Returns:
        The exit status for ``sys.exit`` (75 after a SIGTERM: run the same command again to
        resume; the exit codes page lists them all).
    """
    import os
    import sys

    from hvdtrain.cli import report

    return report(prog or os.path.basename(sys.argv[0]), e)


# The names this module held that moved, or that it no longer hands on: each still works
# (with a DeprecationWarning, once, naming what to use).
_MOVED = {
    "Dataset": (
        "hvdtrain.inputs.arrays",
        "ArrayBatches",
        "hvdtrain.inputs.arrays.ArrayBatches (hk.dataset makes one)",
    ),
    "EXIT_PREEMPTED": ("hvdtrain.base.errors", "EXIT_PREEMPTED", "hk.Preempted.status"),
    "STOP_CHECK_EVERY": (
        "hvdtrain.fit.driver",
        "STOP_CHECK_EVERY",
        "hvdtrain.fit.driver.STOP_CHECK_EVERY",
    ),
    "ConfigError": ("hvdtrain.base.errors", "ConfigError", "hvdtrain.ConfigError"),
    "DataError": ("hvdtrain.base.errors", "DataError", "hvdtrain.data.DataError"),
    "pipeline": ("hvdtrain.inputs.pipeline", None, "hvdtrain.inputs.pipeline"),
}
_warned = set()


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute, instead = _MOVED[name]
    if name not in _warned:
        _warned.add(name)
        _warnings.warn(
            f"hvdtrain.keras.{name} is deprecated: use {instead}", DeprecationWarning, stacklevel=2
        )
    found = _importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)


__all__ = [
    "DistributedOptimizer",
    "Diverged",
    "Error",
    "Preempted",
    "adapt",
    "dataset",
    "datasets",
    "files",
    "fit",
    "init",
    "on_chief",
    "rank",
    "report_error",
    "size",
]
