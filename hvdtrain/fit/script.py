"""What a fit script gives ``hk.fit``, checked before anything trains: the compiled model and
the optimizers it applies (distributed on several ranks), the callbacks (those that write
files run on rank 0; ``BackupAndRestore`` is refused), the validation data, and the settings
(``Config``'s fields that a fit script may pass: ``hvdtrain.base.config``). ``fit_config``
makes the run's ``Config``, recording what the model, its optimizer and the dataset decide."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hvdtrain.base import compat, precision
from hvdtrain.base.config import Config, fit_refusals, setting
from hvdtrain.base.errors import ConfigError, TaskError
from hvdtrain.distributed.optimizer import accumulation, reduce_before_loss_scaling
from hvdtrain.fit.chief import chief_only, keras_proxy
from hvdtrain.inputs import nest, pipeline
from hvdtrain.inputs.arrays import test_shard
from hvdtrain.inputs.sources import is_dataset

# Keras callbacks that write files: rank 0 runs them, the other ranks leave them out (each
# would write the same files). BackupAndRestore is refused: it would restore one rank alone.
RANK0_CALLBACKS = ("ModelCheckpoint", "TensorBoard", "CSVLogger")
REFUSED_CALLBACKS = {
    "BackupAndRestore": "hk.fit checkpoints and resumes by itself (run_dir, "
    "checkpoint_every): leave it out"
}


def user_callbacks(callbacks, world) -> list:
    """The user's callbacks that run on this rank (see RANK0_CALLBACKS); chief-only ones
    (``hk.on_chief``, the trackers' callbacks: ``chief``) on rank 0 alone, each call bounded."""
    keras = compat.keras()
    wrapped = [chief_only(cb) for cb in callbacks]
    callbacks = [
        keras_proxy(keras, w) if w is not None else cb
        for cb, w in zip(callbacks, wrapped)
        if w is None or world.is_chief
    ]
    for cb in callbacks:
        for name, why in REFUSED_CALLBACKS.items():
            if isinstance(cb, getattr(keras.callbacks, name)):
                raise ConfigError("callbacks", name, f"not for hk.fit: {why}")
    rank0 = tuple(getattr(keras.callbacks, name) for name in RANK0_CALLBACKS)
    kept = [cb for cb in callbacks if world.is_chief or not isinstance(cb, rank0)]
    if not world.is_chief:  # Keras' own lines (EarlyStopping's "early stopping", ...): once
        for cb in kept:
            if isinstance(cb, keras.callbacks.Callback) and isinstance(
                getattr(cb, "verbose", None), int
            ):
                cb.verbose = 0
    return kept


@dataclasses.dataclass
class FitSettings:
    """The fit path's own run-defining settings (config.json's ``settings``)."""

    shuffle: bool = setting(True, "a new permutation of the examples every epoch")
    train_examples: int = setting(0, "training examples (a tf.data pipeline: trained per epoch)")
    input: str = setting(
        "arrays",
        "the training input: arrays (hk.dataset), or a tf.data "
        "pipeline sharded by file, by element (data) or by the user",
    )
    steps_per_epoch: int = setting(0, "steps per epoch given to hk.fit (0: counted)")


def fit_config(model, train, epochs: int, world, **settings) -> Config:
    """``Config`` for a fit: ``settings`` by Config's names and with Config's defaults; the
    learning rate, momentum, batch and seed recorded from the optimizer and the dataset."""
    if "class_weight" in settings:
        raise ConfigError(
            "class_weight",
            "...",
            "not supported by hk.fit (the exact global "
            "metrics sum unweighted examples): weight the loss instead",
        )
    for name, why in fit_refusals().items():
        if name in settings:
            raise ConfigError(name, settings[name], f"not an hk.fit setting: {why}")
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise TypeError(f"hk.fit() got unexpected keyword argument(s) {', '.join(unknown)}")
    config = Config(
        epochs=epochs,
        batch_size=train.batch_size,
        seed=train.seed,
        backend=world.backend,
        **settings,
    ).validate()
    check_compiled(model, world)
    optimizer = applied_optimizers(model)[0][1]  # the GAN pattern: the first it applies
    passes = accumulation(optimizer)
    if train.steps % passes:
        # Every epoch ends on an update, so that its end (a checkpoint) holds no
        # half-accumulated gradients and the next epoch's first update is whole.
        raise ConfigError(
            "backward_passes_per_step",
            passes,
            f"must divide the {train.steps} "
            f"steps of an epoch ({train.examples} examples in batches of "
            f"{train.batch_size} x {world.size} ranks): choose a batch_size "
            "that makes it so",
        )
    # What the compiled optimizer really uses (None for a schedule): recorded, not checked.
    return dataclasses.replace(
        config,
        learning_rate=_number(optimizer, "learning_rate"),
        momentum=_number(optimizer, "momentum"),
        steps_per_execution=steps_per_execution(model),
        accumulate_steps=passes,
        mixed_precision=precision.model_precision(model),
    )


def steps_per_execution(model) -> int:
    """model.compile's steps_per_execution (Keras 2 keeps it in a variable)."""
    n = getattr(model, "steps_per_execution", None)
    if n is None:
        n = getattr(model, "_steps_per_execution", None)
    try:
        return max(1, int(np.asarray(n)))
    except (TypeError, ValueError):
        return 1


def applied_optimizers(model) -> list:
    """[(name, optimizer)]: the optimizers the model applies. ``model.optimizer``, and the
    optimizers it keeps as attributes of its own: the GAN pattern (Keras' guide) compiles with
    ``compile(d_optimizer=..., g_optimizer=...)`` and ``super().compile()``, which gives
    ``model.optimizer`` a default Keras never applies when the model's own ``train_step``
    applies the others; then those are the ones that count."""
    keras = compat.keras()
    base = keras.optimizers.Optimizer
    own = getattr(model, "optimizer", None)
    others = [
        (name, v)
        for name, v in vars(model).items()
        if isinstance(v, base) and v is not own and not name.startswith("_")
    ]
    custom = type(model).train_step is not keras.Model.train_step
    return others if others and custom else [("optimizer", own)] + others


def check_compiled(model, world) -> None:
    """The model is compiled, and on several ranks each optimizer it applies is distributed
    (a plain one would train one independent model per rank)."""
    if getattr(model, "optimizer", None) is None:
        raise TaskError(
            "hk.fit: the model is not compiled: call model.compile(optimizer="
            "hk.DistributedOptimizer(...), loss=..., metrics=...) first"
        )
    for name, optimizer in applied_optimizers(model):
        # Keras 3 under mixed_float16: compile put the loss scaler outside; reduce first.
        optimizer = reduce_before_loss_scaling(optimizer)
        # Keras 2 under mixed_float16: the scaler outside Horovod's wrapper is the right order.
        inner = getattr(optimizer, "inner_optimizer", None)
        distributed = any(
            getattr(o, "_hvdtrain_reduction", None) is not None or _horovods_wrapper(o)
            for o in (optimizer, inner)
        )
        if world.size > 1 and not distributed:
            raise TaskError(
                f"hk.fit: the model's {name} ({type(optimizer).__name__}) is not "
                f"distributed: the {world.size} ranks would train {world.size} "
                f"independent models; compile with hk.DistributedOptimizer(optimizer)"
            )


def _horovods_wrapper(optimizer) -> bool:
    """Horovod's own DistributedOptimizer (``horovod.tensorflow.keras``)? Under Keras 3 its
    class keeps the wrapped class's module and name (a saved model loads without Horovod):
    its Horovod method tells it."""
    return type(optimizer).__module__.startswith("horovod") or callable(
        getattr(type(optimizer), "_horovod_setup", None)
    )


def check_validation(validation_data, train, world, sharded=False):
    """(x, y) shaped like the training examples, at least one example per rank; a tf.data
    pipeline: this rank's shard of it."""
    if validation_data is None:
        return None
    if is_dataset(validation_data):
        return pipeline.validation(validation_data, world, sharded)
    if not (isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3)):
        raise ConfigError(
            "validation_data",
            type(validation_data).__name__,
            "give (x_val, y_val) or (x_val, y_val, sample_weight_val)",
        )
    parts = tuple(nest.arrays(a) for a in validation_data)
    names = ("x", "y", "sample_weight")
    counts = [len(a) for part in parts for _, a in nest.leaves(part) if np.ndim(a)]
    if len(set(counts)) > 1:
        shown = ", ".join(f"{len(nest.leaves(a)[0][1])} {n}" for n, a in zip(names, parts))
        raise ConfigError("validation_data", shown, "x and y must hold the same number of examples")
    trained = (train.sample, getattr(train, "y", None), getattr(train, "sample_weight", None))
    for name, a, b in zip(names, parts, trained):
        if b is None or not all(hasattr(leaf, "shape") for _, leaf in nest.leaves(b)):
            continue
        mine, theirs = nest.shapes(a), nest.shapes(b)
        if set(mine) != set(theirs):
            raise ConfigError(
                "validation_data",
                f"{name} of {sorted(mine)}",
                f"must be structured like the training {name}'s {sorted(theirs)}",
            )
        for path, shape in mine.items():
            if shape != theirs[path]:
                rows = len(nest.leaves(a)[0][1])
                raise ConfigError(
                    "validation_data",
                    f"{name}{path} of shape {[rows, *shape]}",
                    f"examples must be shaped like the "
                    f"training {name}{path}'s {list(theirs[path])}",
                )
    n = counts[0] if counts else 0
    if n < world.size:
        raise ConfigError(
            "validation_data",
            f"{n} example(s)",
            f"fewer than the {world.size} ranks: each rank scores its own part "
            "of it, and none may be empty",
        )
    return parts


def validation_shard(validation_data, world, batch_size):
    """(validation input, its steps or None, its batch size) for model.fit: this rank's
    part of the arrays (each example on one rank), or the user's batched pipeline."""
    if validation_data is None:
        return None, None, batch_size
    if (
        isinstance(validation_data, tuple)
        and len(validation_data) == 2
        and is_dataset(validation_data[0])
    ):
        # Batched by the user; its counted batches: Keras 3 warns when it runs dry.
        return (*validation_data, None)
    n = len(nest.leaves(validation_data[0])[0][1])
    part = test_shard(n, world.rank, world.size)
    return tuple(nest.take(a, part) for a in validation_data), None, batch_size


def _number(optimizer, name):
    """The optimizer's setting as the user wrote it (None for a schedule, or none): a float32
    variable's value as the shortest decimal that float32 rounds to it, 0.1, not the
    0.10000000149011612 it holds."""
    try:
        value = np.asarray(getattr(optimizer, name))
        number = float(value)
    except (AttributeError, TypeError, ValueError):
        return None
    if value.dtype != np.float32 or number == 0 or not math.isfinite(number):
        return number
    exponent = math.floor(math.log10(abs(number)))
    for digits in range(1, 10):  # 9 significant digits tell every float32 apart
        shortest = round(number, digits - 1 - exponent)
        if np.float32(shortest) == value:
            return shortest
    return number
