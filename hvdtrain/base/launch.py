"""What the launcher says, without Horovod: how many processes it started, this one's
rank, and the cores this process may use. Read before Horovod starts (and by the doctor)."""

from __future__ import annotations

import os

# Variables launchers set in every process they start: mpirun (Open MPI, MPICH/Hydra,
# MVAPICH), horovodrun --gloo, and srun.
LAUNCHER_SIZE_VARS = (
    "HOROVOD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "MV2_COMM_WORLD_SIZE",
    "SLURM_STEP_NUM_TASKS",
)


def launcher_size(environ=os.environ) -> int:
    """The number of processes a launcher says it started (1 when there is no launcher)."""
    sizes = []
    for name in LAUNCHER_SIZE_VARS:
        try:
            sizes.append(int(environ.get(name, "1")))
        except ValueError:
            pass
    return max(sizes, default=1)


def several_processes(environ=os.environ) -> bool:
    """Whether this process is one of several a launcher started (an elastic job may start
    with one): the processes that exchange gradients."""
    return launcher_size(environ) > 1 or environ.get("HOROVOD_ELASTIC") == "1"


def launcher_rank() -> int:
    """This process's rank as the launcher numbered it (0 without a launcher)."""
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
