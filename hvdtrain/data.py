"""A Task's data: ``hvdtrain.data.Data`` (``Task.load_data`` returns one), ``DataError``, the
loaders of MNIST-format datasets, and the order in which each rank takes its examples.

The public face of ``hvdtrain.inputs``: the code is ``hvdtrain.inputs.loaders`` (``Data``,
the loaders) and ``hvdtrain.inputs.arrays`` (the per-rank order). A script's own datasets, as
``keras.datasets`` returns them, are ``hvdtrain.datasets``."""

from hvdtrain.base.errors import DataError
from hvdtrain.inputs.arrays import epoch_plan, steps_per_epoch, test_shard
from hvdtrain.inputs.loaders import (
    DATASETS,
    Data,
    linear_data,
    load_dir,
    load_idx_dir,
    load_mnist_format,
    load_npz,
    load_sample,
    read_idx,
)

__all__ = [
    "DATASETS",
    "Data",
    "DataError",
    "epoch_plan",
    "linear_data",
    "load_dir",
    "load_idx_dir",
    "load_mnist_format",
    "load_npz",
    "load_sample",
    "read_idx",
    "steps_per_epoch",
    "test_shard",
]
