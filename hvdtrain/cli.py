"""The command line of any task: parse its flags, train, turn known failures into one line.

    hvdtrain.cli.run(MyTask())                        # from a user's own __main__
    python -m hvdtrain run mypackage.tasks:MyTask --epochs 3
    python -m hvdtrain.mnist --help                   # the built-in tasks: the same

Exit status: 0 trained; 1 a runtime failure (data file, checkpoint, a failed or frozen
rank, the launcher, Keras, a task that breaks the Task interface's rules); 2 a bad command
line or setting; 75 preempted by SIGTERM after saving a checkpoint (run the same command
again to resume). Nothing is written before the settings are validated.
"""
import sys

from hvdtrain import compat, distributed
from hvdtrain.checkpoint import CheckpointError
from hvdtrain.config import ConfigError, parse_args
from hvdtrain.data import DataError
from hvdtrain.task import TaskError
from hvdtrain.report import RunDirBusy
from hvdtrain.train import EXIT_PREEMPTED, Diverged, Preempted, StepError, train


def _fail(prog: str, message: str, status: int, show: bool = True) -> int:
    if show:
        sys.stderr.write(f"{prog}: error: {message}\n")
        sys.stderr.flush()
    return status


def run(task, argv=None, prog=None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) as ``task``'s flags, train, return the exit
    status. ``task.settings`` takes the values of the task's own flags."""
    prog = prog or f"python -m hvdtrain.{task.name}"
    config = parse_args(task, argv, prog)  # exits 2 with one line on a bad flag
    try:
        train(task, config)
    except ConfigError as e:  # raised alike on every rank: rank 0 says it
        return _fail(prog, str(e), 2, show=distributed.launcher_rank() == 0)
    except Preempted as e:
        if distributed.launcher_rank() == 0:
            sys.stderr.write(f"{prog}: {e}\n")
        return EXIT_PREEMPTED
    except distributed.RankError as e:
        # Every rank raised the same agreed message: rank 0 says it once.
        return _fail(prog, str(e), 1, show=distributed.launcher_rank() == 0)
    except Diverged as e:  # every rank stopped at the same step: rank 0 says it
        return _fail(prog, str(e), 1, show=distributed.launcher_rank() == 0)
    except (DataError, CheckpointError, distributed.LaunchError, compat.KerasVersionError,
            TaskError, StepError, RunDirBusy) as e:
        return _fail(prog, str(e), 1)
    return 0
