"""The process harness of the benchmarks (and of hvdtrain's tests): run hvdtrain as a user would
(``python -m``, ``horovodrun``, ``mpirun``), each process in its own session and bounded in
time, its whole process group killed when the bound passes.

    from hvdtrain.bench import harness
    proc = harness.run(harness.horovodrun(2, "gloo", harness.python("hvdtrain.mnist")),
                       harness.environment(), timeout=180)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
BIN = os.path.dirname(sys.executable)
HOROVODRUN = os.path.join(BIN, "horovodrun")
# A launcher's variables in this process's environment would make a child believe it is
# one of several ranks (and TF_CONFIG, that it is a MultiWorkerMirroredStrategy worker).
INHERITED = (
    "OMPI_COMM_WORLD_SIZE",
    "HOROVOD_SIZE",
    "PMI_SIZE",
    "TF_CONFIG",
    # the launch scripts' interpreter for the ranks (scripts/launch_*.sh): a child
    # runs this venv's; CI's PYTHON names the set-up's interpreter (.ci/run)
    "PYTHON",
)


class Timeout(RuntimeError):
    """A process outlived its bound and was killed with its group; ``out``/``err`` hold what
    it printed."""

    def __init__(self, cmd, timeout, out, err):
        super().__init__(f"timed out after {timeout:.0f}s: {' '.join(map(str, cmd))}")
        self.out, self.err = out, err


def environment(**extra) -> dict:
    """This process's environment for a child: the checkout first on PYTHONPATH, this
    venv's launchers on PATH, TensorFlow's C++ log quiet, output unbuffered, mpirun allowed
    as root (CI and containers run as root), no launcher variables; then ``extra``."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        PATH=BIN + os.pathsep + env.get("PATH", ""),
        TF_CPP_MIN_LOG_LEVEL="3",
        PYTHONUNBUFFERED="1",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    for name in INHERITED:
        env.pop(name, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def python(module: str, *args) -> list:
    """``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *map(str, args)]


def horovodrun(np: int, controller: str, cmd: list) -> list:
    """``horovodrun -np N --mpi|--gloo cmd``: hvdtrain's documented launcher."""
    return [HOROVODRUN, "-np", str(np), f"--{controller}", *cmd]


def mpirun(np: int, cmd: list) -> list:
    return [
        "mpirun",
        "-np",
        str(np),
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        *cmd,
    ]


def start(cmd: list, env: dict, cwd=None) -> subprocess.Popen:
    """Start ``cmd`` in its own session (stdout/stderr to pipes); pair with ``finish``."""
    return subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float):
    """Wait up to ``timeout`` s; past it, kill the whole group. (rc or None, out, err)."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def run(cmd: list, env: dict, timeout: float = 180, cwd=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end; raise ``Timeout`` (its group killed) past ``timeout`` s."""
    rc, out, err = finish(start(cmd, env, cwd), timeout)
    if rc is None:
        raise Timeout(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, rc, out, err)
