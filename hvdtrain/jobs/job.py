"""A job: what each rank of a cluster front runs, made in the driver.

A task (a built-in name, ``package.module:TaskClass`` or a Task) is checked here first: a bad
flag says the task's own line and stops the driver with status 2 before any rank starts. A
script runs as ``python SCRIPT FLAGS``; a function is called with its arguments on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hvdtrain.base.errors import EXIT_USAGE, LaunchError


class JobError(LaunchError):
    """The job did not finish; ``status`` is what the command line exits with."""

    def __init__(self, message: str, status: int = 1, said: bool = False):
        super().__init__(message)
        self.status = status
        self.said = said  # the ranks said why already: nothing more to print


def is_script(target: str) -> bool:
    return target.endswith(".py") or os.path.isfile(target)


def is_task(target) -> bool:
    from hvdtrain.tasks.task import Task

    return isinstance(target, Task) or (isinstance(target, str) and not is_script(target))


def job_for(
    target,
    argv,
    args,
    kwargs,
    prog: str | None,
    front: str,
    dumps: Callable[[object], bytes],
    error: type = JobError,
):
    """(job, default rank count): what each rank runs. ``prog``: the name the ranks' lines
    start with (default ``FRONT TARGET``); ``dumps`` pickles the payload (the front's
    cloudpickle: a function of the driver's ``__main__`` goes by value)."""
    from hvdtrain.tasks.task import Task

    argv = list(argv)
    if isinstance(target, str) and is_script(target):
        if not os.path.isfile(target):
            raise error(f"{target}: no such script", 2)
        return {"kind": "script", "script": os.path.abspath(target), "argv": argv}, None
    if isinstance(target, (str, Task)):
        from hvdtrain.base.flags import parse_args
        from hvdtrain.tasks.task import load_task

        task = load_task(target) if isinstance(target, str) else target
        prog = prog or f"{front} {target if isinstance(target, str) else task.name}"
        try:
            config = parse_args(task, argv, prog)  # a bad flag: its line, then status 2
        except SystemExit as e:
            if e.code in (0, None):  # --help
                raise
            raise error("", EXIT_USAGE, said=True) from None
        payload = {"kind": "task", "task": target, "prog": prog}
        return {"kind": "task", "argv": argv, "payload": dumps(payload)}, config.num_workers
    if callable(target):
        payload = {
            "kind": "function",
            "function": target,
            "args": list(args),
            "kwargs": dict(kwargs or {}),
            "prog": prog or f"{front} {getattr(target, '__name__', 'function')}",
        }
        return {"kind": "function", "argv": [], "payload": dumps(payload)}, None
    raise error(
        f"{target!r}: give a task (a built-in name, package.module:TaskClass "
        "or a Task), a script path or a function",
        2,
    )


def check_counts(error: type, **values) -> None:
    """Each ``name=(value, least)``: an integer of at least ``least`` (None: not given)."""
    for name, (value, least) in values.items():
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < least
        ):
            raise error(f"{name}={value!r}: must be an integer of at least {least}", 2)


def task_argv(target, argv, ranks: int | None, elastic: bool = False) -> list:
    """A task's flags with the launch's rank count (and ``--elastic``) when it has none."""
    argv = list(argv)
    if not is_task(target):
        return argv
    if elastic and "--elastic" not in argv:
        argv.append("--elastic")
    if ranks and not any(a == "--num-workers" or a.startswith("--num-workers=") for a in argv):
        argv += ["--num-workers", str(ranks)]  # the task's count is the launch's
    return argv
