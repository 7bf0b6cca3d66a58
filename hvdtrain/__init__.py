"""hvdtrain: synchronous data-parallel SGD for TensorFlow with Horovod.

    horovodrun -np 2 python -m hvdtrain.mnist      # two processes on this machine
    python -m hvdtrain.linear                      # one process, no launcher

Keras 3 is the default; with ``TF_USE_LEGACY_KERAS=1`` set before the program starts, the
same code runs on Keras 2 (tf_keras). Public API: ``Config``, ``preset``, ``Task``,
``train``, ``DistributedOptimizer`` (see README, "Your own model").
"""
import os as _os

# TensorFlow's C++ INFO/WARNING start-up lines drown the training output; errors stay.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.2.0"

from hvdtrain.config import Config, ConfigError, preset  # noqa: E402
from hvdtrain.optimizer import DistributedOptimizer  # noqa: E402
from hvdtrain.task import Task  # noqa: E402
from hvdtrain.train import train  # noqa: E402

__all__ = ["Config", "ConfigError", "DistributedOptimizer", "Task", "preset", "train",
           "__version__"]
