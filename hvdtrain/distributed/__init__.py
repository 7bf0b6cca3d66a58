"""The distributed layer: everything rank-dependent, and the one part of hvdtrain that
imports Horovod.

    world = distributed.init(backend)     # or distributed.current()
    world.rank, world.size, world.is_chief, world.reduction(...), world.allreduce_sum(...)

- ``world``: the World interface and the single-process World;
- ``horovod_setup``: Horovod's import, its run-time defaults, device and thread pinning;
- ``horovod_world``: HorovodWorld, the gradients' ``Reduction``, elastic state;
- ``sparse``: sparse gradients (an Embedding's) gathered over the ranks or reduced dense;
- ``start``: ``init()`` and ``current()``;
- ``optimizer``: ``DistributedOptimizer`` (the averaged update) and the stop flags that ride in it;
- ``layers``: ``SyncBatchNormalization`` (statistics over the global batch);
- ``statistics``: ``MovingStatistics``, the layers' moving statistics averaged over the ranks.

May import: ``hvdtrain.base`` only. The optimizer wrapper, the doctor and the benchmarks
reach Horovod through this package (``World.reduction``, ``horovod_package()``,
``horovod_tensorflow()``, ``horovod_keras()``, ``World.hvd``). This face hands on the
World's names, so ``from hvdtrain import distributed; distributed.current()`` keeps working.
"""

from hvdtrain.base.errors import RankError
from hvdtrain.base.launch import (
    LAUNCHER_SIZE_VARS,
    launcher_rank,
    launcher_size,
    usable_cores,  # base's, handed on
)
from hvdtrain.distributed.horovod_setup import (
    horovod_keras,
    horovod_package,
    horovod_tensorflow,
    tensorflow_mismatch,
)
from hvdtrain.distributed.horovod_world import HorovodWorld, Reduction, broadcast_variables
from hvdtrain.distributed.start import current, init
from hvdtrain.distributed.world import COMPRESSIONS, OPS, QUESTIONS, Progress, World

__all__ = [
    "COMPRESSIONS",
    "HorovodWorld",
    "LAUNCHER_SIZE_VARS",
    "OPS",
    "Progress",
    "QUESTIONS",
    "RankError",
    "Reduction",
    "World",
    "broadcast_variables",
    "current",
    "horovod_keras",
    "horovod_package",
    "horovod_tensorflow",
    "init",
    "launcher_rank",
    "launcher_size",
    "tensorflow_mismatch",
    "usable_cores",
]
