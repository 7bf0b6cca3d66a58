"""hvdtrain on a Spark cluster: a Task, a fit script or a function, trained by Horovod
processes that run as Spark tasks, with the guarantees of a ``horovodrun`` launch; and
training data from a Spark DataFrame.

    python -m hvdtrain.spark --master spark://head:7077 --num-proc 2 mnist --epochs 3
    python -m hvdtrain.spark --num-proc 2 train.py --run-dir /shared/runs/a   # a fit script

    import hvdtrain.spark
    result = hvdtrain.spark.run("mnist", argv=["--epochs", "3"], num_proc=4)
    result = hvdtrain.spark.run(my_function, num_proc=2)

    hvdtrain.spark.write_parquet(df, "/shared/data/train")        # once, on the driver
    arrays = hvdtrain.spark.read_parquet("/shared/data/train")    # in each rank

Each rank is one Spark task (one core of an executor); Horovod's Spark integration
(``horovod.spark.run``) starts a process in it, which starts the rank as a process of its
own, exactly as ``horovodrun`` starts one: the same flags, output, checkpoints, exact resume,
SIGTERM stop, watchdog and exit statuses (``hvdtrain.spark.driver`` says what ends a job and
what restarts it). The ranks run in the directory the driver was started from, which must
exist on every machine, and a run directory they share must be on storage every executor
sees.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from hvdtrain.spark.driver import SparkJobError
from hvdtrain.spark.parquet import read_parquet, write_parquet

__all__ = ["run", "SparkJobError", "read_parquet", "write_parquet"]

MAX_RESTARTS = 3
START_TIMEOUT = 120  # seconds for Spark to start every rank's task


def run(
    target: str | Callable | Any,
    *,
    argv: Sequence[str] = (),
    args: Sequence = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    spark=None,
    master: str | None = None,
    use_mpi: bool = False,
    max_restarts: int = MAX_RESTARTS,
    start_timeout: int = START_TIMEOUT,
    prog: str | None = None,
) -> Any:
    """Train ``target`` on Horovod processes running as Spark tasks; rank 0's result.

    Args:
        target: a task (a built-in name such as ``"mnist"``, ``"package.module:TaskClass"``,
            or a Task instance) trained with the flags ``argv``, returning result.json's
            dictionary; a script path (a fit script) run with ``argv``, returning None; or a
            function called as ``target(*args, **kwargs)`` on every rank, returning rank 0's
            return value.
        argv: the task's or the script's flags.
        args: the function's positional arguments.
        kwargs: the function's keyword arguments.
        num_proc: the ranks, one Spark task each (default: the task's configured count,
            else the application's default parallelism).
        spark: the SparkSession to run on (default: the active one, else a new one).
        master: the master of the session made when there is none (``spark://HOST:7077``,
            ``yarn``, ``k8s://...``, ``local[N]``; default: what spark-submit or Spark's
            configuration say).
        use_mpi: the ranks talk through Open MPI (``mpirun`` over Horovod's task services)
            instead of Gloo.
        max_restarts: how many times a job whose infrastructure failed (a rank, its executor
            or its machine lost, storage, preemption) starts again from its newest
            checkpoint.
        start_timeout: seconds for Spark to start every rank's task.
        prog: the name the ranks' lines start with (default ``hvdtrain.spark TARGET``).

    Returns:
        Rank 0's result, as above.

    Raises:
        SparkJobError: the job did not finish; its ``status`` is the command line's exit
            status.
    """
    from pyspark import cloudpickle

    from hvdtrain.jobs.job import check_counts, job_for, task_argv
    from hvdtrain.spark.driver import run_job

    check_counts(
        SparkJobError,
        num_proc=(num_proc, 1),
        max_restarts=(max_restarts, 0),
        start_timeout=(start_timeout, 1),
    )
    if spark is not None and master:
        raise SparkJobError(
            f"master={master}: the session given (spark=) has its own "
            f"master ({spark.sparkContext.master}); give one or the other",
            2,
        )
    argv = task_argv(target, argv, num_proc)
    job, configured = job_for(
        target, argv, args, kwargs, prog, "hvdtrain.spark", cloudpickle.dumps, SparkJobError
    )
    job["cwd"] = os.getcwd()
    launch = {
        "num_proc": num_proc or configured,
        "master": master,
        "use_mpi": bool(use_mpi),
        "start_timeout": start_timeout,
    }
    return run_job(job, launch, max_restarts, spark)
