"""A Task's data: ``hvdtrain.data.Data`` (``Task.load_data`` returns one), ``DataError``, and
the loaders of MNIST-format datasets. The code is ``hvdtrain.inputs.data``."""
from hvdtrain.base.errors import DataError  # noqa: F401
from hvdtrain.inputs.data import (DATASETS, Data, epoch_plan, linear_data,  # noqa: F401
                                  load_dir, load_idx_dir, load_mnist_format, load_npz,
                                  load_sample, read_idx, steps_per_epoch, test_shard)

__all__ = ["DATASETS", "Data", "DataError", "epoch_plan", "linear_data", "load_dir",
           "load_idx_dir", "load_mnist_format", "load_npz", "load_sample", "read_idx",
           "steps_per_epoch", "test_shard"]
