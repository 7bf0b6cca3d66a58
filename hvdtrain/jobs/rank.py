"""One rank of a job on a cluster front, started as a process of its own.

The process the cluster gave the rank (a Ray actor, a Spark task's Horovod process) does not
train. It starts the rank as a child process, exactly as ``horovodrun`` starts one (``python
-m hvdtrain.jobs.worker``, or the user's script), with the environment the cluster's Horovod
integration gave it (rank, size, the Gloo rendezvous) plus what the driver forwards. The rank
therefore keeps everything a launched rank has: its own signal handlers (SIGTERM saves a
checkpoint and exits 75), the watchdog's exit statuses, its run directory lock, huge pages
from its first instruction. The parent only:

- relays the child's output, as it comes (``write``);
- forwards a stop the driver asks for (its own SIGINT or SIGTERM) to the child, as that signal
  (``stop_signal``, asked every ``POLL`` seconds; when it raises, the driver is gone: SIGTERM);
- ends the child when the parent itself dies (the child's parent-death signal is SIGTERM: it
  saves at a step the ranks agree on, as a preempted rank does);
- returns the child's exit status, its host, and its result (rank 0's; any rank's in an
  elastic job, whose ranks change).

Imports only the standard library and hvdtrain's: the parent must not import TensorFlow (it
would hold the GPU the child needs).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

from hvdtrain.base import malloc  # the standard library's only
from hvdtrain.base.launch import launcher_rank
from hvdtrain.jobs.outcome import failed

PR_SET_PDEATHSIG = 1
POLL = 0.25  # seconds between two looks at the driver's stop request
CHUNK = 1 << 16  # bytes relayed at once


def _rank_start() -> None:
    """In the child between fork and exec: SIGINT and SIGTERM delivered (a cluster's worker
    processes may block SIGINT, and a blocked mask is inherited: the rank could not be
    stopped), and SIGTERM when the parent dies."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def child_env(job: dict, environ=os.environ) -> dict:
    """The rank's environment: the parent's (Horovod's variables among them), then what the
    driver forwards, without overriding Horovod's; huge pages set before the child starts."""
    env = dict(environ)
    for name, value in job["env"].items():
        if not name.startswith("HOROVOD_") or name not in env:
            env[name] = value
    paths = [p for p in (job["cwd"], job["env"].get("PYTHONPATH"), environ.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(os.pathsep.join(paths).split(os.pathsep)))
    value = malloc.tunables(env)
    if value:
        env["GLIBC_TUNABLES"] = value
    return env


def run_rank(
    job: dict, write: Callable[[str, bytes], None], stop_signal: Callable[[], int]
) -> dict:
    """Run this process's rank to its end; what the driver needs of it. ``write(stream,
    chunk)`` relays the child's output ("out" or "err"); ``stop_signal()`` is the signal the
    driver asks the ranks to stop with (0: none yet)."""
    rank = launcher_rank()  # Horovod's (Gloo) or mpirun's
    host = socket.gethostname()
    answer = failed(rank, host, None, None)  # until the child says otherwise
    if not os.path.isdir(job["cwd"]):
        answer["error"] = (
            f"the driver's working directory {job['cwd']} does not exist on "
            f"host {host}: start the driver from a directory every node sees"
        )
        answer["status"] = 1
        return answer
    with tempfile.TemporaryDirectory(prefix="hvdtrain-rank-") as tmp:
        result_path = os.path.join(tmp, "result.pickle")
        if job["kind"] == "script":
            cmd = [sys.executable, job["script"], *job["argv"]]
        else:
            # The task's flags on the command line (what ps shows), the rest on stdin.
            cmd = [sys.executable, "-m", "hvdtrain.jobs.worker", result_path, *job["argv"]]
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=job["cwd"],
                env=child_env(job),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=_rank_start,
            )
        except OSError as e:
            answer["error"], answer["status"] = f"cannot start {cmd[0]} on {host}: {e}", 1
            return answer

        def relay(stream, name):
            fd = stream.fileno()
            while True:
                chunk = os.read(fd, CHUNK)
                if not chunk:
                    return
                write(name, chunk)

        threads = [
            threading.Thread(target=relay, args=(proc.stdout, "out"), daemon=True),
            threading.Thread(target=relay, args=(proc.stderr, "err"), daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            proc.stdin.write(job.get("payload", b""))
            proc.stdin.close()
        except OSError:  # the child ended before reading it: its status says why
            pass
        forwarded = False
        while proc.poll() is None:
            try:
                proc.wait(POLL)
            except subprocess.TimeoutExpired:
                pass
            if not forwarded:
                try:
                    stop = stop_signal()
                except Exception:  # noqa: BLE001 (the driver is gone: stop as it would ask)
                    stop = signal.SIGTERM
                if stop:
                    proc.send_signal(stop)
                    forwarded = True
        for t in threads:
            t.join(10)
        code = proc.returncode
        answer["status"] = code if code >= 0 else 128 - code
        answer["signal"] = signal.Signals(-code).name if code < 0 else None
        if code == 0 and (rank == 0 or job.get("elastic")) and os.path.exists(result_path):
            with open(result_path, "rb") as f:
                answer["result"] = f.read()  # pickled by the child; the driver loads it
    return answer
