"""Every error hvdtrain reports in one line, with the exit status it ends a program with.

``Error`` is the base: ``str()`` is the one line a user sees, ``status`` the exit status the
command line returns (1 unless said otherwise). ``Together`` marks an error that every rank
raises at the same point (an agreed check, a reduced flag, a setting that is the same
everywhere): rank 0 alone reports it, and no rank needs to stop the others. Any other error
is one rank's: that rank reports it, and the watchdog stops its peers.

The command line, the training loop and the fit path ask these two attributes; none of them
keeps a list of classes.
"""

from __future__ import annotations

import errno
import re
from typing import Any

# The exit statuses. 1 and 2 are the user's to fix: the same command fails the same way again.
# 69, 73, 74 and 75 are the infrastructure's: the same command, run again later, resumes from
# the newest checkpoint (a cluster's launcher retries them; scripts/k8s_launcher.sh does).
EXIT_FAILED = 1  # a runtime failure: data, checkpoint, diverged, the launcher, Keras
EXIT_USAGE = 2  # a bad flag, setting or task name
EXIT_PEER_LOST = 69  # EX_UNAVAILABLE: a rank died or froze (the watchdog); its node, usually
EXIT_RUN_DIR_HELD = 73  # EX_CANTCREAT: the run directory's lock outlived HVDTRAIN_LOCK_WAIT
EXIT_STORAGE = 74  # EX_IOERR: the storage failed under a write (EIO, ESTALE, a timeout)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM after saving; rerun to resume
"""The exit status after a SIGTERM (``Preempted``): a checkpoint was saved, and the same
command run again resumes from it."""
RETRIED = (EXIT_PEER_LOST, EXIT_RUN_DIR_HELD, EXIT_STORAGE, EXIT_PREEMPTED)

# Write errors of a storage that is failing or unreachable, not full or misconfigured: a
# network file system's server gone (ESTALE, ETIMEDOUT, EHOSTDOWN...), a disk's I/O error.
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, n)
    for n in (
        "EIO",
        "ESTALE",
        "ETIMEDOUT",
        "ENOTCONN",
        "ECONNRESET",
        "ECONNREFUSED",
        "EHOSTDOWN",
        "EHOSTUNREACH",
        "ENETDOWN",
        "ENETUNREACH",
        "ENOLCK",
        "EREMOTEIO",
    )
    if hasattr(errno, n)
)


class Error(Exception):
    """The base of every error hvdtrain raises: one line, and an exit status.

    ``str(e)`` is the line a user sees. A fit script catches ``hk.Error`` and ends with
    ``sys.exit(hk.report_error(e))``.

    Attributes:
        status: the exit status the program ends with (1 unless the class says otherwise;
            the exit codes page lists them).
        together: True when every rank raises it at the same point (rank 0 alone reports
            it); False when it is one rank's.
    """

    status = EXIT_FAILED
    together = False
    said: bool = False  # its line was said already (the watchdog's verdict): not again


class Together(Error):
    """Raised identically on every rank at the same point of the run."""

    together = True


# --- bad input: exit 2 -------------------------------------------------------------------------


class ConfigError(Together, ValueError):
    """A bad setting; exit status 2.

    ``str(e)`` is ``--flag=value: reason`` (the command line's flag) or, raised through a
    fit script's call, ``hk.fit(name=value): reason``.

    Args:
        name: the setting (a ``Config`` field's or an argument's name).
        value: the value refused.
        reason: why.
        call: the call that took it (``"hk.fit"``), or None for the command line.

    Attributes:
        flag: the setting's flag (``--learning-rate``).
        name: the setting.
        value: the value refused.
        reason: why.
        call: the call that took it, or None.
    """

    status = EXIT_USAGE

    def __init__(self, name: str, value, reason: str, call: str | None = None):
        self.flag = "--" + name.replace("_", "-")
        self.name, self.value, self.reason, self.call = name, value, reason, call
        shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        super().__init__(
            f"{call}({name}={shown}): {reason}" if call else f"{self.flag}={shown}: {reason}"
        )

    def in_call(self, call: str) -> ConfigError:
        """The same refusal, naming the argument of a call rather than a flag.

        Args:
            call: the call the user wrote (``"hk.fit"``, ``"hk.dataset"``).

        Returns:
            A ``ConfigError`` that says ``call(name=value): reason``; this one when it
            already names a call.
        """
        return self if self.call else ConfigError(self.name, self.value, self.reason, call)


def shown(value) -> str:
    """A setting's value as the user wrote it: a float read back from a float32 variable
    (the optimizer's learning rate, 0.10000000149011612) shown as its float32 (0.1)."""
    if isinstance(value, float):
        import numpy as np

        if float(np.float32(value)) == value:
            return repr(float(str(np.float32(value))))
    return str(value)


class EnvError(Together, ValueError):
    """A bad HVDTRAIN_* environment variable, found on every rank; ``str()`` names it."""

    status = EXIT_USAGE


class SpecError(Error, ValueError):
    """A task name that names no Task class."""

    status = EXIT_USAGE


# --- the run's own failures: exit 1 --------------------------------------------------------------


class TaskError(Together, ValueError):
    """The task's code broke one of the Task interface's rules; exit status 1.

    For example a ``loss`` that does not return one value per example, or an exception
    raised in the user's own ``build_model``: the line names the method and the user's file
    and line.
    """


class KerasVersionError(Together, RuntimeError):
    """The Keras in use cannot train with hvdtrain; the line says the fix."""


class RankError(Together, RuntimeError):
    """One or more ranks failed a step that all ranks take together."""


class Diverged(Together, RuntimeError):
    """The loss (or the weights) became NaN or infinite; exit status 1.

    Every rank stops at that step; the checkpoints from before it are kept
    (``stop_on_divergence=False`` trains on instead).
    """


class RanksDiffer(Together, RuntimeError):
    """The ranks' models differ after synchronous updates: something updated one rank's."""


class DataError(Error, RuntimeError):
    """A data file is missing, corrupt or not what the task expects; exit status 1.

    A task's ``load_data`` raises it for a bad file: every rank then stops with one line.
    """


class InputError(Together, DataError):
    """The input as a whole cannot train (an empty shard): every rank found it together."""


class CheckpointError(Error, RuntimeError):
    """No usable checkpoint where one is required."""


class LaunchError(Error, RuntimeError):
    """The processes cannot train together as launched."""


class RunDirBusy(Error, RuntimeError):
    """Another live run on this host holds the run directory."""


class RunDirHeld(Together, RuntimeError):
    """The run directory's lock is still held after ``HVDTRAIN_LOCK_WAIT`` seconds by a run
    elsewhere (another node, or a dead one whose lock the file server keeps for its lease):
    exit 73, retried."""

    status = EXIT_RUN_DIR_HELD


class StepError(Error, RuntimeError):
    """A training step failed on this rank (e.g. a label outside the model's classes); the
    line names the step and the rank."""


class CallbackError(Error, RuntimeError):
    """A callback that runs on rank 0 alone (``hk.on_chief``) raised, or outran its time
    bound, there: one rank's error, which the watchdog takes to the others."""


class StorageError(Together, RuntimeError):
    """Rank 0 cannot write a file of the run (disk full, read-only, a file where a directory
    belongs): ``cannot write PATH: [Errno 28] No space left on device``. Rank 0 tells every
    rank at the write, so all stop together. Exit 74 when the errno in the line is one of
    ``TRANSIENT_ERRNOS`` (the storage failed: retried), else 1 (full, read-only, no
    permission: the user's to fix)."""

    @property
    def status(self) -> int:  # type: ignore[override]  # Error's class attribute, read here
        found = re.search(r"\[Errno (\d+)\]", str(self))
        return EXIT_STORAGE if found and int(found.group(1)) in TRANSIENT_ERRNOS else EXIT_FAILED


# --- not a failure: exit 75 -----------------------------------------------------------------------


class Preempted(Together, RuntimeError):
    """A SIGTERM reached a rank: every rank stopped after the same step; exit status 75.

    Rank 0 saved a checkpoint at that step: the same command run again resumes from it.
    """

    status = EXIT_PREEMPTED
    world: Any = None  # the run's World (Run.preempt): the ranks wait for rank 0's line


# TensorFlow's op errors begin with a header and a trace of where the op was defined; the
# kernel's own message (Horovod's "Mismatched BROADCAST tensor shapes: ... [11, 4] ... [10, 4]",
# a py_function's "ValueError: record 7 is unreadable") comes after them, then the node.
TF_HEADER = "Graph execution error"
TF_TRACE = (TF_HEADER, "Detected at node", "<stack traces unavailable>", "File ", "[[", "Traceback")


def first_line(message) -> str:
    """The first non-blank line of an error message: what a one-line report shows; for a
    TensorFlow op error, its cause (the kernel's message, or the exception a py_function
    raised), not the "Graph execution error:" header, the traces (indented) or the node."""
    raw = [line for line in str(message).splitlines() if line.strip()]
    lines = [line.strip() for line in raw]
    if lines and lines[0].startswith(TF_HEADER):
        causes = [
            line.strip()
            for line in raw
            if not line[0].isspace() and not line.strip().startswith(TF_TRACE)
        ]
        return _op_suffix(causes[0]) if causes else lines[0]
    return _op_suffix(lines[0]) if lines else "unknown error"


# tf.data's wrapping of an error raised in a user's map (filter, ...) function.
TF_DATA_FN = re.compile(
    r"Error in user-defined function passed to (\w+?)(?:Dataset)?(?::\d+)? "
    r"transformation with iterator: \S+: (.+)"
)


def _op_suffix(line: str) -> str:
    """A line without TensorFlow's "{{function_node ...}}" prefix and "[Op:...]" suffix, and
    tf.data's "Error in user-defined function passed to MapDataset:1 transformation with
    iterator: Iterator::Root::...: " said as what it is."""
    if line.startswith("{{function_node") and "}}" in line:
        line = line.split("}}", 1)[1].strip()
    line = line.split(" [Op:")[0].rstrip() or line
    wrapped = TF_DATA_FN.match(line)
    if wrapped:
        line = f"{wrapped.group(2)} (in the function given to tf.data's {wrapped.group(1).lower()})"
    return line


def step_failed(e: BaseException, where: str, rank: int):
    """A TensorFlow op error of ``where`` ("training step 44") on this rank as ``StepError``
    (its cause, the step, the rank); None for Horovod's own (a lost peer: not the input's)."""
    if "Horovod" in str(getattr(e, "message", e)):
        return None
    return StepError(f"{where} failed on rank {rank}: {first_line(e)}")


def error_line(e: BaseException) -> str:
    """``Type: first line`` of an exception."""
    return f"{type(e).__name__}: {first_line(e)}"


# --- the user's own code --------------------------------------------------------------------------


def show_tracebacks() -> bool:
    """HVDTRAIN_TRACEBACK=1: let errors in the user's code (and hvdtrain's own) through
    with their full traceback instead of one line."""
    import os

    return os.environ.get("HVDTRAIN_TRACEBACK", "") in ("1", "true", "yes")


def user_frame(e: BaseException) -> str:
    """ " (file:line)" of the innermost frame of ``e``'s traceback that is the user's code:
    not hvdtrain's, not an installed package's, not Python's own; "" if there is none."""
    import os
    import traceback

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hvdtrain/
    found = ""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError) and e.filename:  # the error is in the file being compiled
        frames.append(traceback.FrameSummary(e.filename, e.lineno or 0, "<module>"))
    for frame in frames:
        path = os.path.abspath(frame.filename)
        if (
            path.startswith(here + os.sep)
            or "-packages" + os.sep in path
            or frame.filename.startswith("<")
            or os.sep + "lib" + os.sep + "python" in path
        ):
            continue
        found = f" ({frame.filename}:{frame.lineno})"
    return found


class user_code:
    """``with user_code("MyTask.build_model"):`` an exception from the block that is not
    hvdtrain's own becomes a TaskError: one line with the exception and the user's frame."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, Error) or not isinstance(e, Exception) or show_tracebacks():
            return False
        raise TaskError(f"{self.what} raised {error_line(e)}{user_frame(e)}") from None
