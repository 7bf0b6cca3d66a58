"""The run directory: its layout (``RunDir``: the path of everything a run writes there), its
default name, why a path cannot hold a new or continued run, and the lock by which rank 0
holds it for the whole run (a second run on it is refused, a dead holder's lease waited out).
docs/reference/run-directory.md describes each file."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import socket
import sys
import time

from hvdtrain.base.config import env_number
from hvdtrain.base.errors import RunDirBusy, RunDirHeld
from hvdtrain.base.files import make_dirs, writing

# The run directory's layout: the names of what rank 0 writes there.
CONFIG, METRICS, RESULT = "config.json", "metrics.jsonl", "result.json"
CHECKPOINTS, TENSORBOARD = "checkpoints", "tensorboard"
MODEL, MODEL_WEIGHTS = "model.keras", "model.weights.h5"
TRACKING, LOCK = "tracking.json", ".lock"
# What a run directory holds as folders: a file named like one would make every save fail.
FOLDERS = (CHECKPOINTS, TENSORBOARD)
# Where default run directories go, under the current directory.
ROOT = "runs"


@dataclasses.dataclass(frozen=True)
class RunDir:
    """One run's directory (an absolute path) and the paths of what it holds.

    Every module that reads or writes a run directory's file asks this for its path.
    """

    path: str

    def __post_init__(self):
        object.__setattr__(self, "path", os.path.abspath(self.path))

    @classmethod
    def resolve(cls, given, task: str, world) -> RunDir:
        """The run directory of a run: ``given`` (``--run-dir``, ``run_dir=``), else a new
        one named after ``task`` by rank 0 (its clock decides) and told to the other ranks.

        Args:
            given: the path the user gave, or None.
            task: the run's name (``mnist``, ``fit``).
            world: the ranks that agree on it.

        Returns:
            The RunDir, the same on every rank.
        """
        if given:
            return cls(given)
        return cls(world.broadcast_object(default_run_dir(task) if world.is_chief else None))

    def __str__(self) -> str:
        return self.path

    def _join(self, name: str) -> str:
        return os.path.join(self.path, name)

    config = property(lambda self: self._join(CONFIG), doc="config.json")
    metrics = property(lambda self: self._join(METRICS), doc="metrics.jsonl")
    result = property(lambda self: self._join(RESULT), doc="result.json")
    checkpoints = property(lambda self: self._join(CHECKPOINTS), doc="checkpoints/")
    tensorboard = property(lambda self: self._join(TENSORBOARD), doc="tensorboard/")
    model = property(lambda self: self._join(MODEL), doc="model.keras")
    model_weights = property(lambda self: self._join(MODEL_WEIGHTS), doc="model.weights.h5")
    tracking = property(lambda self: self._join(TRACKING), doc="tracking.json")
    lock_file = property(lambda self: self._join(LOCK), doc=".lock")

    def problem(self):
        """Why this directory cannot hold a new or continued run (``run_dir_problem``)."""
        return run_dir_problem(self.path)

    def lock(self, wait: float | None = None) -> RunLock:
        """Hold this directory for this run (``RunLock``)."""
        return RunLock(self.path, wait)


def job_run_dir(job: str, task: str, root: str = ROOT) -> str:
    """A batch job's run directory, ``runs/JOB-TASK``: named without a time or a job id, so
    that the same job submitted again (or requeued) finds its checkpoints. ``task`` as the
    job names it (a spec ``pkg.mod:Task`` too), its other characters made ``_``."""
    return os.path.abspath(os.path.join(root, f"{job}-{re.sub(r'[^A-Za-z0-9._-]', '_', task)}"))


def default_run_dir(task: str, root: str = ROOT) -> str:
    """A new run directory for ``task``: ``runs/TASK-TIME`` (``-2``, ... if taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(root, f"{task}-{stamp}"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{task}-{stamp}-{n}")
    return path


def run_dir_problem(path: str):
    """Why ``path`` cannot hold a new or continued run (None when it can). Creates nothing.

    A file where the directory should be, a file above it, no permission to write, or a
    finished run (result.json) with no checkpoint to continue from: each would fail late,
    with a traceback, or silently overwrite a finished run.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"is under {existing}, which is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be written ({existing}: permission denied or read-only file system)"
    for name in FOLDERS:
        inside = os.path.join(path, name)
        if os.path.exists(inside) and not os.path.isdir(inside):
            return (
                f"holds a file {name} where its {name}/ folder belongs: move it away "
                f"(and put the {name} back, to resume)"
            )
    checkpoints = os.path.join(path, CHECKPOINTS)
    if os.path.exists(os.path.join(path, RESULT)) and not (
        os.path.isdir(checkpoints) and any(n.endswith(".hvdt") for n in os.listdir(checkpoints))
    ):
        return (
            "holds a finished run (result.json) and no checkpoint to continue from: "
            "choose a new one rather than overwrite it"
        )
    return None


LOCK_WAIT = 120.0  # HVDTRAIN_LOCK_WAIT's default: NFSv4's 90 s lease, and a margin


def lock_wait() -> float:
    """HVDTRAIN_LOCK_WAIT: seconds to wait for a run directory held by a run elsewhere."""
    return env_number(
        "HVDTRAIN_LOCK_WAIT",
        LOCK_WAIT,
        lambda v: 0 <= v <= 86400,
        f"give seconds from 0 to 86400 (default {LOCK_WAIT:g})",
    )


def _identity(pid: int) -> str:
    """What tells a live process apart from a later one with the same pid and host name (a
    re-created pod): this boot of the machine and the process's start time."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
    return f"boot {boot} start {start}"


class RunLock:
    """Rank 0's exclusive hold on a run directory for the whole run.

    ``flock`` on RUN_DIR/.lock: on a local file system the kernel drops it when the holder
    exits, however it exits (SIGKILL included), so a lock left by a killed run never blocks
    the next one; the file keeps the holder's pid, host and start time for the message a
    second run gets, and (line 2) what identifies that process. On a network file system a
    crashed node's lock stays with the server until the node's lease expires (NFSv4: 90 s):
    a holder that is not a live process of this host is therefore waited for, up to
    ``HVDTRAIN_LOCK_WAIT`` seconds (``RunDirHeld``, exit 73, after that); a live one here is
    refused at once (``RunDirBusy``: two runs on one directory, the user's to fix).
    """

    def __init__(self, run_dir: str, wait: float | None = None):
        path = os.path.join(run_dir, LOCK)
        with writing(path):
            make_dirs(run_dir)
            self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if not self._take():
            holder, identity = self._holder()
            wait = lock_wait() if wait is None else wait
            if self._live_here(holder, identity) or not self._wait(run_dir, holder, wait):
                os.close(self._fd)
                if self._live_here(holder, identity):
                    raise RunDirBusy(
                        f"{run_dir} is in use by another run ({holder}): wait "
                        "for it to end, or choose another --run-dir"
                    ) from None
                raise RunDirHeld(
                    f"{run_dir} is still locked after {wait:g} s by a run "
                    f"elsewhere ({holder}): a run on another node, or a crashed "
                    "node's lock the file server keeps; retry later (exit 73), "
                    "or choose another --run-dir"
                ) from None
        with writing(path):
            self._write(
                f"pid {os.getpid()} on {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n{_identity(os.getpid())}\n"
            )

    def _take(self) -> bool:
        assert self._fd is not None  # open from __init__ until release()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _holder(self):
        assert self._fd is not None  # open from __init__ until release()
        lines = os.pread(self._fd, 1024, 0).decode(errors="replace").splitlines() + ["", ""]
        return lines[0].strip() or "unknown", lines[1].strip()

    @staticmethod
    def _live_here(holder: str, identity: str) -> bool:
        """The holder is a process of this host that still lives (the same one: same boot,
        same start time), not a dead node's or another pod's."""
        words = holder.split()
        if len(words) < 4 or words[0] != "pid" or words[2] != "on" or not words[1].isdigit():
            return False
        return (
            words[3] == socket.gethostname()
            and bool(identity)
            and _identity(int(words[1])) == identity
        )

    def _wait(self, run_dir: str, holder: str, wait: float) -> bool:
        if wait <= 0:
            return False
        sys.stderr.write(
            f"hvdtrain: {run_dir} is locked by a run elsewhere ({holder}): "
            f"waiting up to {wait:g} s (HVDTRAIN_LOCK_WAIT) for its lock to "
            "end\n"
        )
        sys.stderr.flush()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            if self._take():
                return True
        return False

    def _write(self, text: str) -> None:
        assert self._fd is not None  # open from __init__ until release()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
