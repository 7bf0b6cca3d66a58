"""hvdtrain on a Ray cluster: a Task, a fit script or a function, trained by Horovod workers
that Ray places, with the guarantees of a ``horovodrun`` launch.

    python -m hvdtrain.ray --num-workers 4 --cpus-per-worker 2 mnist --epochs 3
    python -m hvdtrain.ray --num-workers 2 train.py --run-dir /shared/runs/a   # a fit script

    import hvdtrain.ray
    result = hvdtrain.ray.run("mnist", argv=["--epochs", "3"], num_workers=4)
    result = hvdtrain.ray.run(my_function, num_workers=2, use_gpu=True)

Each worker is a Horovod worker actor (``horovod.ray.RayExecutor``: one placement-group
bundle of ``cpus_per_worker`` CPUs, and ``gpus_per_worker`` GPUs, per worker), and starts its
rank as a process of its own, exactly as ``horovodrun`` starts one: the same flags, output,
checkpoints, exact resume, SIGTERM stop, watchdog and exit statuses
(``hvdtrain.ray.driver`` says what ends a job and what restarts it). The ranks run in the
directory the driver was started from, which must exist on every node, and a run directory
they share must be on storage every node sees.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from hvdtrain.ray.driver import RayJobError

__all__ = ["run", "RayJobError"]

MAX_RESTARTS = 3
PLACEMENT_TIMEOUT = 120  # seconds to wait for the cluster to have room for every worker
COOLDOWN = (10, 60)  # an elastic job's lost address is tried again after 10 s, then longer


def run(
    target: str | Callable | Any,
    *,
    argv: Sequence[str] = (),
    args: Sequence = (),
    kwargs: dict | None = None,
    num_workers: int | None = None,
    cpus_per_worker: int = 1,
    gpus_per_worker: int = 0,
    use_gpu: bool = False,
    address: str | None = None,
    max_restarts: int = MAX_RESTARTS,
    placement_timeout: int = PLACEMENT_TIMEOUT,
    min_workers: int | None = None,
    max_workers: int | None = None,
    cooldown: Sequence[int] = COOLDOWN,
    prog: str | None = None,
) -> Any:
    """Train ``target`` on Horovod workers of a Ray cluster; rank 0's result.

    Args:
        target: a task (a built-in name such as ``"mnist"``, ``"package.module:TaskClass"``,
            or a Task instance) trained with the flags ``argv``, returning result.json's
            dictionary; a script path (a fit script) run with ``argv``, returning None; or a
            function called as ``target(*args, **kwargs)`` on every rank, returning rank 0's
            return value.
        argv: the task's or the script's flags.
        args: the function's positional arguments.
        kwargs: the function's keyword arguments.
        num_workers: the ranks (default: the task's configured count, else 1).
        cpus_per_worker: the Ray CPUs each worker reserves.
        gpus_per_worker: the Ray GPUs each worker reserves (1: one rank per GPU).
        use_gpu: ``gpus_per_worker=1``.
        address: the Ray cluster's address (default: ``RAY_ADDRESS``, a cluster started on
            this machine, else a new one here for the job).
        max_restarts: how many times a job whose infrastructure failed (a rank or its node
            lost, storage, preemption) starts again from its newest checkpoint.
        placement_timeout: seconds to wait for room for every worker.
        min_workers: an elastic job (a task gets ``--elastic``) on at least this many ranks:
            a lost rank or node leaves the others going on from their last commit.
        max_workers: an elastic job's most ranks (default: every free slot).
        cooldown: (least, most) seconds before an elastic job tries a failed address again:
            a node that returns joins after it.
        prog: the name the ranks' lines start with (default ``hvdtrain.ray TARGET``).

    Returns:
        Rank 0's result, as above.

    Raises:
        RayJobError: the job did not finish; its ``status`` is the command line's exit
            status.
    """
    from ray import cloudpickle

    from hvdtrain.jobs.job import check_counts, job_for, task_argv
    from hvdtrain.ray.driver import run_job

    if use_gpu and not gpus_per_worker:
        gpus_per_worker = 1
    elastic = min_workers is not None or max_workers is not None
    if elastic and num_workers is not None:
        raise RayJobError("num_workers or min_workers/max_workers: a job is elastic or not", 2)
    if elastic:
        min_workers = min_workers or 1
        if max_workers is not None and max_workers < min_workers:
            raise RayJobError(
                f"max_workers={max_workers}: must be at least min_workers={min_workers}", 2
            )
    check_counts(
        RayJobError,
        num_workers=(num_workers, 1),
        min_workers=(min_workers, 1),
        max_workers=(max_workers, 1),
        cpus_per_worker=(cpus_per_worker, 1),
        gpus_per_worker=(gpus_per_worker, 0),
        max_restarts=(max_restarts, 0),
        placement_timeout=(placement_timeout, 1),
    )
    argv = task_argv(target, argv, num_workers, elastic)
    job, configured = job_for(
        target, argv, args, kwargs, prog, "hvdtrain.ray", cloudpickle.dumps, RayJobError
    )
    job["cwd"] = os.getcwd()
    placement = {
        "num_workers": num_workers or configured or 1,
        "cpus_per_worker": cpus_per_worker,
        "gpus_per_worker": gpus_per_worker,
        "timeout_s": placement_timeout,
    }
    if elastic:
        placement.update(min_workers=min_workers, max_workers=max_workers, cooldown=tuple(cooldown))
        job["elastic"] = True
    return run_job(job, placement, address, max_restarts)
