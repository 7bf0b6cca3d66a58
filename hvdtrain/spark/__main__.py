"""``python -m hvdtrain.spark [options] TARGET [ITS FLAGS]``: train on a Spark cluster.

    python -m hvdtrain.spark --master spark://head:7077 --num-proc 4 mnist --epochs 3
    python -m hvdtrain.spark --num-proc 2 train.py --run-dir /shared/a

TARGET is a task (a built-in name or package.module:TaskClass, with its flags after it) or a
script (a path). Exit status: the ranks' (as under horovodrun: 0, 1, 2, 69, 73, 74, 75), after
at most --max-restarts restarts of a job whose infrastructure failed.
"""

import argparse

from hvdtrain.jobs import cli

PROG = "python -m hvdtrain.spark"


def parser() -> argparse.ArgumentParser:
    from hvdtrain.spark import MAX_RESTARTS, START_TIMEOUT

    def options(p):
        p.add_argument(
            "--master",
            default=None,
            help="the Spark master (spark://HOST:7077, yarn, k8s://..., local[N]; "
            "default: spark-submit's or Spark's configuration, else local)",
        )
        p.add_argument(
            "--num-proc",
            type=int,
            default=None,
            help="ranks to start, one Spark task each (default: the task's configured "
            "count, else Spark's default parallelism)",
        )
        p.add_argument(
            "--mpi", action="store_true", help="the ranks talk through Open MPI instead of Gloo"
        )
        p.add_argument(
            "--max-restarts",
            type=int,
            default=MAX_RESTARTS,
            help="restarts from the newest checkpoint after a lost rank, executor or "
            "storage (default %(default)s)",
        )
        p.add_argument(
            "--start-timeout",
            type=int,
            default=START_TIMEOUT,
            help="seconds for Spark to start every rank's task (default %(default)s)",
        )

    return cli.parser(
        PROG, "Train a task or a fit script on Horovod processes that run as Spark tasks.", options
    )


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    def call():
        from hvdtrain.spark import run

        return run(
            args.target,
            argv=args.args,
            num_proc=args.num_proc,
            master=args.master,
            use_mpi=args.mpi,
            max_restarts=args.max_restarts,
            start_timeout=args.start_timeout,
            prog=f"{PROG} {args.target}",
        )

    return cli.front_main(PROG, ("pyspark", "horovod.spark"), "PySpark", "spark", call)


if __name__ == "__main__":
    from hvdtrain.cli import exit_now

    exit_now(main())
