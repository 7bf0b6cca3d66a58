"""hvdtrain: synchronous data-parallel SGD for TensorFlow with Horovod.

    horovodrun -np 2 python -m hvdtrain.mnist      # two processes on this machine
    python -m hvdtrain.linear                      # one process, no launcher
    horovodrun -np 2 python -m hvdtrain run mypackage.tasks:MyTask   # your own task

Keras 3 is the default; with ``TF_USE_LEGACY_KERAS=1`` set before the program starts, the
same code runs on Keras 2 (tf_keras). Public API: ``Task``, ``train``, ``Config``,
``setting``, ``preset``, ``world``, ``DistributedOptimizer``, ``SyncBatchNormalization``
(``hvdtrain.layers``), ``hvdtrain.cli.run``, and the
Keras ``fit`` path in ``hvdtrain.keras`` (see docs/guides/keras-fit.md).

The code stands in layers, each package importing only those below it (its docstring says
which): ``base`` (errors, settings, files, the Keras in use); ``inputs`` and
``distributed`` (the data each rank trains on; everything rank-dependent, Horovod); ``engine``
(one run's life, its checkpoints and run directory); the two drivers over it, ``tasks`` (the
Task path, with the built-in tasks) and ``fit`` (``hk.fit``); then the public modules here
(``keras``, ``cli``, ``doctor`` over ``doctor_probes``, ``datasets``; ``mnist`` and
``linear``, the built-in tasks' commands; ``compat``, ``data`` and ``layers`` hand on their
public names). ``bench`` (the benchmarks and their process harness, ``python -m
hvdtrain.bench``; its plots need the ``bench`` extra) is for developers: nothing else imports it.
"""

# hvdtrain's first code: a launched rank whose environment lacks glibc's huge-page tunable
# starts itself again with it, before anything is imported (glibc reads it only at start;
# hvdtrain/base/malloc.py says when, and why that is safe here).
from hvdtrain.base import malloc as _malloc

_malloc.reexec()

# The clock of result.json's timings starts here (hvdtrain/base/timings.py); its wall and
# startup count from the process's start, so a re-exec above is in them.
from hvdtrain.base import timings as _timings  # noqa: E402

with _timings.phase("imports"):
    import os as _os

    # TensorFlow's C++ INFO/WARNING start-up lines drown the training output; errors stay.
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # ... and its start-up lines on a machine without a GPU, which that level does not reach
    # (hvdtrain/base/tflogs.py; HVDTRAIN_TF_LOGS=1 shows them).
    from hvdtrain.base import tflogs as _tflogs

    _tflogs.install()
    _timings.install()  # after tflogs: the first import of TensorFlow is timed, quiet or not

    # hvdtrain.compat (the Keras in use, for a user's code) after `import hvdtrain` alone.
    from hvdtrain import compat  # noqa: F401 (for the attribute: not a re-export)
    from hvdtrain._version import __version__
    from hvdtrain.base.config import Config, ConfigError, setting
    from hvdtrain.distributed.optimizer import DistributedOptimizer
    from hvdtrain.tasks.task import Task, TaskError, load_task
    from hvdtrain.tasks.train import train


def preset(task: str, **overrides) -> Config:
    """A built-in task's training configuration, with some settings changed.

    Args:
        task: a built-in task's name (``"linear"``, ``"mnist"``) or
            ``"package.module:Class"``.
        **overrides: ``Config`` fields to set, by name (``learning_rate=0.1``).

    Returns:
        The task's ``Config``: its defaults, then ``overrides``, validated.

    Raises:
        ConfigError: a value in ``overrides`` is out of range.
        ValueError: ``task`` names no task.
        TypeError: ``overrides`` names no ``Config`` field.
    """
    return load_task(task).config(**overrides)


def world():
    """This process's place in the job.

    Horovod is started if hvdtrain has not started it yet (one process without a launcher).

    Returns:
        The World: ``.rank``, ``.size``, ``.local_rank``, ``.local_size`` and ``.is_chief``
        (rank 0, which prints and writes the run directory).
    """
    from hvdtrain import distributed

    return distributed.current()


def __getattr__(name):
    # Imported on first use: the class depends on the Keras in use, and importing hvdtrain
    # does not import TensorFlow.
    if name == "SyncBatchNormalization":
        from hvdtrain.distributed import layers

        return layers.SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Config",
    "ConfigError",
    "DistributedOptimizer",
    "SyncBatchNormalization",
    "Task",
    "TaskError",
    "preset",
    "setting",
    "train",
    "world",
    "__version__",
]
