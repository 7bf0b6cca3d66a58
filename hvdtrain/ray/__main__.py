"""``python -m hvdtrain.ray [options] TARGET [ITS FLAGS]``: train on a Ray cluster.

    python -m hvdtrain.ray --num-workers 4 --cpus-per-worker 2 mnist --epochs 3
    python -m hvdtrain.ray --num-workers 2 --gpus-per-worker 1 train.py --run-dir /shared/a

TARGET is a task (a built-in name or package.module:TaskClass, with its flags after it) or a
script (a path). Exit status: the ranks' (as under horovodrun: 0, 1, 2, 69, 73, 74, 75), after
at most --max-restarts restarts of a job whose infrastructure failed.
"""

import argparse

from hvdtrain.jobs import cli

PROG = "python -m hvdtrain.ray"


def parser() -> argparse.ArgumentParser:
    from hvdtrain.ray import MAX_RESTARTS, PLACEMENT_TIMEOUT

    def options(p):
        p.add_argument(
            "--address",
            default=None,
            help="the Ray cluster's address (default: RAY_ADDRESS, a cluster started "
            "on this machine, else a new one here)",
        )
        p.add_argument(
            "--num-workers",
            type=int,
            default=None,
            help="ranks to start (default: the task's configured count, else 1)",
        )
        p.add_argument("--cpus-per-worker", type=int, default=1, help="Ray CPUs per worker")
        p.add_argument(
            "--gpus-per-worker",
            type=int,
            default=0,
            help="Ray GPUs per worker (1: one rank per GPU)",
        )
        p.add_argument(
            "--max-restarts",
            type=int,
            default=MAX_RESTARTS,
            help="restarts from the newest checkpoint after a lost rank, node or "
            "storage (default %(default)s)",
        )
        p.add_argument(
            "--placement-timeout",
            type=int,
            default=PLACEMENT_TIMEOUT,
            help="seconds to wait for room for every worker (default %(default)s)",
        )
        p.add_argument(
            "--min-workers",
            type=int,
            default=None,
            help="an elastic job: at least this many ranks (a task gets --elastic)",
        )
        p.add_argument(
            "--max-workers",
            type=int,
            default=None,
            help="an elastic job: at most this many ranks (default: every free slot)",
        )

    return cli.parser(
        PROG, "Train a task or a fit script on Horovod workers of a Ray cluster.", options
    )


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    def call():
        from hvdtrain.ray import run

        return run(
            args.target,
            argv=args.args,
            num_workers=args.num_workers,
            cpus_per_worker=args.cpus_per_worker,
            gpus_per_worker=args.gpus_per_worker,
            address=args.address,
            max_restarts=args.max_restarts,
            placement_timeout=args.placement_timeout,
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            prog=f"{PROG} {args.target}",
        )

    return cli.front_main(PROG, ("ray", "horovod.ray"), "Ray", "ray", call)


if __name__ == "__main__":
    from hvdtrain.cli import exit_now

    exit_now(main())
