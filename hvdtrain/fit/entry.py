"""One ``hk.fit`` call put together: its training input as a ``TrainBatches`` (``hk.dataset``'s
arrays, or a ``tf.data`` pipeline sharded and counted here), the run's ``Config``, the
engine's ``Run``, and ``FitRun`` training in it."""

from __future__ import annotations

from hvdtrain.base import timings
from hvdtrain.base.errors import ConfigError
from hvdtrain.distributed.start import current
from hvdtrain.engine.fronts import FIT_SCRIPT
from hvdtrain.engine.run import Run
from hvdtrain.fit.driver import FitRun
from hvdtrain.fit.script import FitSettings, fit_config, user_callbacks
from hvdtrain.inputs.pipeline import Batches
from hvdtrain.inputs.sources import is_dataset


def fit_model(
    model,
    train,
    epochs,
    validation_data,
    callbacks,
    validation_batch_size,
    steps_per_epoch,
    sharded,
    settings: dict,
):
    """``hk.fit``'s arguments, checked, trained on every rank: the Keras History."""
    if is_dataset(train):
        with timings.phase("data"):
            train = Batches(train, current(), sharded, steps_per_epoch)
        source = "tf.data " + train.policy
    elif steps_per_epoch is not None or sharded:
        raise ConfigError(
            "steps_per_epoch" if steps_per_epoch is not None else "sharded",
            steps_per_epoch if steps_per_epoch is not None else sharded,
            "for a tf.data.Dataset only (hk.dataset counts its own steps)",
        )
    else:
        source = "arrays"
    world = train.world
    config = fit_config(model, train, epochs, world, **settings)
    callbacks = user_callbacks(list(callbacks), world)  # some write files: rank 0's alone
    fit_settings = FitSettings(train.shuffle, train.examples, source, steps_per_epoch or 0)
    with Run(world, config, FIT_SCRIPT, fit_settings) as run:
        return FitRun(model, train, validation_data, run, sharded).fit(
            list(callbacks), validation_batch_size
        )
