"""The command line of any task: parse its flags, train, turn known failures into one line.

    hvdtrain.cli.run(MyTask())                        # from a user's own __main__
    python -m hvdtrain run mypackage.tasks:MyTask --epochs 3
    python -m hvdtrain.mnist --help                   # the built-in tasks: the same
    python -m hvdtrain run-dir [--job NAME] TASK [flags]   # the run directory they name

Exit status: 0 trained; 1 a runtime failure (data file, checkpoint, diverged, the launcher,
Keras, a task that breaks the Task interface's rules); 2 a bad command line or setting; and
the infrastructure's, after which the same command resumes: 69 a rank died or froze (the
watchdog), 73 the run directory still locked by a run elsewhere, 74 the storage failed
(EIO, ESTALE, ...), 75 preempted by SIGTERM after saving a checkpoint. Nothing is written
before the settings are validated. Each status is an error class's (``hvdtrain.base.errors``).
With HVDTRAIN_EXIT_FILE set (scripts/k8s_launcher.sh sets it), a rank that ends with 1 or 2
appends ``rank R status S`` to that file: a launcher tells hvdtrain's own 1 from mpirun's.

``python -m hvdtrain...`` ends with ``exit_now``: Python's exit without its teardown.
"""

import atexit
import os
import sys
import threading

from hvdtrain import distributed
from hvdtrain.base.errors import RETRIED, Error, Preempted, RunDirBusy, first_line
from hvdtrain.base.flags import given_run_dir, parse_args
from hvdtrain.base.waits import call_within
from hvdtrain.engine.rundir import RunDir, job_run_dir
from hvdtrain.tasks.train import train

RUN_DIR_USAGE = "usage: python -m hvdtrain run-dir [--job NAME] TASK [flags]"


def report(prog: str, e: Error) -> int:
    """Say ``e`` in one line on stderr and return its exit status. An error raised on every
    rank together is said once, by rank 0; so is one rank's error that the watchdog took to
    rank 0 (``said``)."""
    note_exit(e.status, "run directory busy" if isinstance(e, RunDirBusy) else "")
    if getattr(e, "said", False):
        return e.status
    if not e.together or distributed.launcher_rank() == 0:
        label = "" if isinstance(e, Preempted) else "error: "
        sys.stderr.write(f"{prog}: {label}{e}\n")
        sys.stderr.flush()
    world = getattr(e, "world", None)  # a preemption: every rank waits for rank 0's line,
    if world is not None and world.size > 1:  # since mpirun ends the job at the first
        try:  # rank's exit and its line would be lost with it
            world.barrier()
        except Exception:  # noqa: BLE001 (the line is said; the status is the same)
            pass
    return e.status


def note_exit(status: int, cause: str = "") -> None:
    """HVDTRAIN_EXIT_FILE: say that this rank ended with one of the user's statuses (1, 2),
    for a launcher that must not retry them (mpirun's own status 1 is not written). A
    ``cause`` after the status marks a 1 that is not the user's under that launcher: the run
    directory held by a live process of this host (in a Kubernetes worker pod, the ranks of
    an earlier launcher of the same job)."""
    path = os.environ.get("HVDTRAIN_EXIT_FILE")
    if not path or status in RETRIED:
        return
    try:
        with open(path, "a") as f:
            f.write(
                f"rank {distributed.launcher_rank()} status {status}"
                f"{f' ({cause})' if cause else ''}\n"
            )
    except OSError:
        pass  # the launcher then retries: the safe side


# Seconds a rank's Horovod shutdown may take at the end of a run. Under mpirun it is
# MPI_Finalize, which waits for mpirun: a launcher whose node is gone (no connection closed:
# a Kubernetes launcher pod's node lost) never answers, and the rank, with everything written
# (every rank left the run's last collective), would wait forever. Normally it takes 1-2 s.
FINALIZE_WAIT = 30


def horovod_shutdown_hangs() -> bool:
    """Shut Horovod down if it runs (its atexit handler is then a no-op), waiting at most
    FINALIZE_WAIT seconds: True when it did not end in time."""
    hvd = sys.modules.get("horovod.tensorflow")
    try:
        running = hvd is not None and hvd.is_initialized()
    except Exception:  # noqa: BLE001 (a half-loaded Horovod: its own atexit handler decides)
        return False
    if not running:
        return False
    ended, error = call_within(hvd.shutdown, FINALIZE_WAIT, name="horovod-shutdown")
    if error is not None:
        print(f"hvdtrain: warning: Horovod's shutdown: {first_line(str(error))}", file=sys.stderr)
    return not ended


def exit_now(status: int) -> None:
    """End this process with ``status``: what Python does at exit for any program (wait for
    its non-daemon threads, run the atexit handlers, Horovod's shutdown among them, flush
    stdout and stderr), but not the interpreter's teardown of every module after it; and
    Horovod's shutdown first, bounded (``FINALIZE_WAIT``): a rank whose launcher is gone
    exits instead of waiting for it forever.

    hvdtrain's own command line owns its process, and when ``run`` returns, everything the
    run writes is written and closed. Tearing down TensorFlow's and Keras' thousands of
    modules took 1.4-2.1 s of each process's exit on 2 cores: as long as the README's first
    command trains (docs/performance/startup.md, "Where a short run's time goes").
    """
    shutdown = getattr(threading, "_shutdown", None)  # what Python's own exit calls first
    if shutdown is None:  # not CPython: its ordinary exit
        raise SystemExit(status)
    shutdown()
    if horovod_shutdown_hangs():
        print(
            f"hvdtrain: warning: Horovod's shutdown (MPI_Finalize) did not end within "
            f"{FINALIZE_WAIT} s (the launcher gone?): exiting with status {status} without it",
            file=sys.stderr,
        )
    else:
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(status)


def run(task, argv=None, prog=None, on_result=None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) as ``task``'s flags, train, return the exit
    status. ``task.settings`` takes the values of the task's own flags; ``on_result`` (if
    given) is called with what the run returned (result.json's dict) when it trained."""
    prog = prog or f"python -m hvdtrain.{task.name}"
    try:
        try:
            config = parse_args(task, argv, prog)  # exits 2 with one line on a bad flag
        except SystemExit as e:
            if e.code not in (0, None):
                note_exit(e.code)
            raise
        result = train(task, config)
        if on_result is not None:
            on_result(result)
    except Error as e:
        return report(prog, e)
    except KeyboardInterrupt:  # Ctrl-C before training started (after: a preemption, 75)
        sys.stderr.write(f"{prog}: interrupted (SIGINT) before training started: nothing saved\n")
        return 130
    return 0


def run_dir(argv) -> int:
    """``python -m hvdtrain run-dir [--job NAME] TASK [flags]``: print the run directory that
    TASK's flags name, as an absolute path, and return 0: a launcher script's answer, taken
    as hvdtrain takes ``--run-dir``, without loading the task (a spec, ``pkg.mod:Task``, too).
    With no ``--run-dir``: with ``--job NAME``, a batch job's (``job_run_dir``: runs/NAME-TASK
    under the current directory, the same when the job is submitted again); else nothing is
    printed (the run makes runs/TASK-TIME itself). A bad command line: one line, exit 2."""
    argv = list(argv)
    job = None
    if argv[:1] == ["--job"] and len(argv) >= 2:
        job, argv = argv[1], argv[2:]
    elif argv[:1] and argv[0].startswith("--job="):
        job, argv = argv[0].partition("=")[2], argv[1:]
    if not argv or argv[0].startswith("-") or job == "":
        sys.stderr.write(f"hvdtrain: error: run-dir needs a task; {RUN_DIR_USAGE}\n")
        return 2
    given = given_run_dir(argv[1:], f"python -m hvdtrain run-dir {argv[0]}")
    if given is not None:
        print(RunDir(given).path)
    elif job is not None:
        print(job_run_dir(job, argv[0]))
    return 0
