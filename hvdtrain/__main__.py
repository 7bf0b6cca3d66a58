"""``python -m hvdtrain``: train a built-in task or any task class by name.

python -m hvdtrain mnist [flags]                  # = python -m hvdtrain.mnist [flags]
python -m hvdtrain run package.module:Task [flags]   # a user's own Task subclass
python -m hvdtrain package.module:Task [flags]       # the same
python -m hvdtrain workers TASK [flags]           # the worker count those flags configure
                                                  # (the launch scripts start that many)
python -m hvdtrain run-dir [--job NAME] TASK [flags]   # the run directory they name
"""

import sys

from hvdtrain.base.errors import Error, SpecError
from hvdtrain.base.flags import parse_args
from hvdtrain.tasks.task import BUILTIN, load_task

USAGE = (
    "usage: python -m hvdtrain {linear,mnist} [flags] | run MODULE:TASK [flags] | "
    "workers TASK [flags] | run-dir [--job NAME] TASK [flags]  (--help after the task)"
)


def main(argv=None) -> int:
    from hvdtrain.cli import run

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else SpecError.status
    command, rest = argv[0], argv[1:]
    if command == "run-dir":
        from hvdtrain.cli import run_dir

        return run_dir(rest)
    try:
        if command == "workers" and rest:
            task = load_task(rest[0])
            # A task that does not configure a count gets one process per local slot: 1.
            print(
                parse_args(task, rest[1:], f"python -m hvdtrain workers {rest[0]}").num_workers or 1
            )
            return 0
        if command == "run" and rest:
            return run(load_task(rest[0]), rest[1:], f"python -m hvdtrain run {rest[0]}")
        if command in BUILTIN or ":" in command:  # a task spec works without "run" too
            return run(
                load_task(command),
                rest,
                None if command in BUILTIN else f"python -m hvdtrain {command}",
            )
    except Error as e:  # the task named: not found, or broken before it could train
        sys.stderr.write(f"hvdtrain: error: {e}\n")
        return e.status
    if command in ("run", "workers"):  # without a task
        sys.stderr.write(
            f"hvdtrain: error: {command} needs a task (a built-in name or "
            f"package.module:TaskClass); {USAGE}\n"
        )
        return SpecError.status
    sys.stderr.write(f"hvdtrain: error: unknown command {command!r}; {USAGE}\n")
    return SpecError.status


if __name__ == "__main__":
    from hvdtrain.cli import exit_now

    exit_now(main())  # without the interpreter's teardown
