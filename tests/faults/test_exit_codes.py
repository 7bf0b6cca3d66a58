"""Exit statuses that tell a cluster what to do: the user's mistakes (1, 2) and the
infrastructure's (69, 73, 74, 75), the run directory's lock waiting out a dead node's lease,
and scripts/k8s_launcher.sh retrying every status but the ones hvdtrain's ranks say are theirs.

Pure Python and bash, about 10 s in all: the lock is taken in this process (flock conflicts
between two open files of one process too), the launcher runs against a stand-in for
scripts/launch_cluster.sh (no mpirun, no worker to reach).
"""

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from hvdtrain.base import errors
from hvdtrain.base.errors import EnvError, RunDirBusy, RunDirHeld, StorageError
from hvdtrain.base.files import cannot_write
from hvdtrain.engine.rundir import RunLock, lock_wait

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.quick


def test_each_status_is_its_own():
    assert (
        errors.EXIT_FAILED,
        errors.EXIT_USAGE,
        errors.EXIT_PEER_LOST,
        errors.EXIT_RUN_DIR_HELD,
        errors.EXIT_STORAGE,
        errors.EXIT_PREEMPTED,
    ) == (1, 2, 69, 73, 74, 75)
    assert set(errors.RETRIED) == {69, 73, 74, 75}
    from hvdtrain.engine import watchdog

    assert watchdog.EXIT_PEER_LOST == 69  # what a rank exits with when a peer is lost


@pytest.mark.parametrize(
    "number, status",
    [
        (errno.EIO, 74),
        (errno.ESTALE, 74),
        (errno.ETIMEDOUT, 74),  # the storage failed
        (errno.ENOSPC, 1),
        (errno.EROFS, 1),
        (errno.EACCES, 1),
        (errno.ENOTDIR, 1),
    ],
)  # the user's
def test_a_storage_error_is_retried_only_when_the_storage_failed(number, status):
    e = cannot_write(
        "/runs/x/checkpoints/ckpt-000000200.hvdt", OSError(number, os.strerror(number))
    )
    assert e.status == status
    assert StorageError(str(e)).status == status  # as rank 0 tells the other ranks


def hold_elsewhere(run_dir, holder="pid 4242 on hvdtrain-worker-0 since 2026-01-01 00:00:00"):
    """The run directory's lock as a crashed node's lease keeps it: held, by no live process
    of this host. The descriptor: closing it ends the lease."""
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(os.path.join(run_dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, f"{holder}\nboot 00000000-dead start 1\n".encode(), 0)
    return fd


def test_the_run_dir_lock_waits_out_a_dead_holders_lease(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    fd = hold_elsewhere(run_dir)
    threading.Timer(1.5, os.close, [fd]).start()  # the lease ends
    t = time.monotonic()
    lock = RunLock(run_dir, wait=20)
    assert 1.4 < time.monotonic() - t < 5
    assert "waiting up to 20 s (HVDTRAIN_LOCK_WAIT)" in capsys.readouterr().err
    with open(os.path.join(run_dir, ".lock")) as f:
        assert f.readline().startswith(f"pid {os.getpid()} on ")
    lock.release()


def test_a_lock_held_past_the_wait_is_exit_73_and_a_live_one_here_is_refused_at_once(tmp_path):
    run_dir = str(tmp_path / "run")
    fd = hold_elsewhere(run_dir)
    try:
        t = time.monotonic()
        with pytest.raises(RunDirHeld) as held:
            RunLock(run_dir, wait=1)
        assert 0.9 < time.monotonic() - t < 4
        assert held.value.status == 73 and "still locked after 1 s" in str(held.value)
        assert "hvdtrain-worker-0" in str(held.value)
    finally:
        os.close(fd)
    first = RunLock(run_dir, wait=20)  # a live run of this host: no wait, the user's mistake
    try:
        t = time.monotonic()
        with pytest.raises(RunDirBusy) as busy:
            RunLock(run_dir, wait=20)
        assert time.monotonic() - t < 1 and busy.value.status == 1
        assert f"in use by another run (pid {os.getpid()} on " in str(busy.value)
    finally:
        first.release()


def test_lock_wait_setting(monkeypatch):
    monkeypatch.delenv("HVDTRAIN_LOCK_WAIT", raising=False)
    assert lock_wait() == 120
    monkeypatch.setenv("HVDTRAIN_LOCK_WAIT", "0")
    assert lock_wait() == 0
    for bad in ("soon", "-1"):
        monkeypatch.setenv("HVDTRAIN_LOCK_WAIT", bad)
        with pytest.raises(EnvError, match=f"HVDTRAIN_LOCK_WAIT={bad}: give seconds"):
            lock_wait()


def test_note_exit_writes_the_users_statuses_only(tmp_path, monkeypatch):
    from hvdtrain.cli import note_exit

    path = tmp_path / "exit"
    monkeypatch.setenv("HVDTRAIN_EXIT_FILE", str(path))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    for status in (69, 73, 74, 75, 2, 1):
        note_exit(status)
    note_exit(1, "run directory busy")  # RunDirBusy's: not the user's under the launcher
    assert path.read_text() == (
        "rank 3 status 2\nrank 3 status 1\nrank 3 status 1 (run directory busy)\n"
    )


# --- scripts/k8s_launcher.sh's verdicts ---------------------------------------------------------
FAKE_LAUNCH = """#!/usr/bin/env bash
# launch_cluster.sh's stand-in: the ranks' HVDTRAIN_EXIT_FILE lines, then mpirun's status.
[[ -n ${FAKE_SAYS:-} ]] && echo "rank 0 status $FAKE_SAYS" >>"$HVDTRAIN_EXIT_FILE"
echo launched >>"$FAKE_LOG"
exit "$FAKE_STATUS"
"""


@pytest.fixture()
def launcher(tmp_path):
    scripts = tmp_path / "image" / "scripts"
    scripts.mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "k8s_launcher.sh"), scripts)
    (scripts / "launch_cluster.sh").write_text(FAKE_LAUNCH)
    (scripts / "launch_cluster.sh").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("")  # no worker to wait for
    run_dir = tmp_path / "claim" / "run"

    def run(status, says="", job="2f1c-uid"):
        # PYTHON: the image's interpreter, which the launcher asks for the run directory.
        env = dict(
            os.environ,
            OMPI_MCA_orte_default_hostfile=str(hostfile),
            FAKE_STATUS=str(status),
            FAKE_SAYS=says,
            FAKE_LOG=str(tmp_path / "log"),
            HVDTRAIN_LAUNCHER_JOB=job,
            PYTHON=sys.executable,
            PYTHONPATH=ROOT,
        )
        p = subprocess.run(
            [str(scripts / "k8s_launcher.sh"), "linear", "--run-dir", str(run_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        log = tmp_path / "log"
        launches = len(log.read_text().splitlines()) if log.exists() else 0
        return p.returncode, p.stderr, launches, (run_dir / "k8s-launcher-failed").exists()

    return run


@pytest.mark.parametrize(
    "status, says",
    [
        (1, ""),  # mpirun's own 1: a node lost, no rank said it was the user's
        (69, ""),
        (73, ""),
        (74, ""),
        (75, ""),
        (255, ""),
        (1, "69"),  # a rank's line for another status does not make mpirun's 1 the user's
        (1, "1 (run directory busy)"),  # an earlier launcher's rank in the same pod holds it
    ],
)
def test_the_launcher_leaves_the_infrastructures_statuses_to_the_retries(launcher, status, says):
    for attempt in (1, 2):  # each retry runs mpirun again
        rc, err, launches, marked = launcher(status, says)
        assert (rc, launches, marked) == (status, attempt, False), err
        assert f"status {status} is the infrastructure's" in err


@pytest.mark.parametrize("status", [1, 2])
def test_the_launcher_does_not_run_the_users_mistake_again(launcher, status):
    rc, err, launches, marked = launcher(status, says=str(status))
    assert (rc, launches, marked) == (status, 1, True), err
    rc, err, launches, marked = launcher(status, says=str(status))
    assert (rc, launches) == (status, 1), err  # not launched again
    assert f"not run again: the same command ended with status {status}" in err


def test_the_users_mistake_holds_back_its_own_jobs_retries_only(launcher):
    """The record is the launcher Job's (its UID): a new MPIJob with the same arguments (a
    fixed image, fixed data) runs; its own failure is then the one recorded."""
    rc, err, launches, marked = launcher(2, says="2", job="job-a")
    assert (rc, launches, marked) == (2, 1, True), err
    rc, err, launches, marked = launcher(2, says="2", job="job-a")
    assert (rc, launches) == (2, 1) and "not run again" in err, err  # job-a's retry
    rc, err, launches, marked = launcher(0, job="job-b")
    assert (rc, launches, marked) == (0, 2, False), err  # a new job: run, and it trained
