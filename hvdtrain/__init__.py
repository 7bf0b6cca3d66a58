"""hvdtrain: synchronous data-parallel SGD for TensorFlow with Horovod.

    horovodrun -np 2 python -m hvdtrain.mnist      # two processes on this machine
    python -m hvdtrain.linear                      # one process, no launcher

Public API: ``Config``, ``preset``, ``Task``, ``train`` (see README, "Your own model").
"""
import os as _os

# Horovod 0.28.1 works with Keras 2 only (Keras 3 fails at the first step:
# "'Variable' object has no attribute 'ref'"). TensorFlow picks its Keras when tf.keras is
# first touched, so this must be set before that; hvdtrain.compat checks it took effect.
_os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# TensorFlow's C++ INFO/WARNING start-up lines drown the training output; errors stay.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"

from hvdtrain.config import Config, ConfigError, preset  # noqa: E402
from hvdtrain.task import Task  # noqa: E402
from hvdtrain.train import train  # noqa: E402

__all__ = ["Config", "ConfigError", "Task", "preset", "train", "__version__"]
