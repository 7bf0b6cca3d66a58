"""One rank of a job on Ray: what runs in each Horovod worker actor that ``RayExecutor`` placed.

The actor does not train in its own process. It starts the rank as a child process, exactly as
``horovodrun`` starts one (``python -m hvdtrain.ray.worker``, or the user's script), with the
environment Horovod's Ray integration gave the actor (rank, size, the Gloo rendezvous) plus
what the driver forwards. The rank therefore keeps everything a launched rank has: its own
signal handlers (SIGTERM saves a checkpoint and exits 75), the watchdog's exit statuses, its
run directory lock, huge pages from its first instruction. The actor only:

- relays the child's output, as it comes, to the driver's ``Hub`` (the driver prints it);
- forwards a stop the driver asks for (its own SIGINT or SIGTERM) to the child, as that signal;
- ends the child when the actor itself dies (the child's parent-death signal is SIGTERM: it
  saves at a step the ranks agree on, as a preempted rank does);
- returns the child's exit status, its host, and rank 0's result (any rank's in an elastic
  job, whose ranks change).

Imports only the standard library and Ray's: the actor has Horovod and Ray loaded already,
and must not import TensorFlow (it would hold the GPU the child needs).
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

from hvdtrain.base import malloc  # the standard library's only

PR_SET_PDEATHSIG = 1
POLL = 0.25       # seconds between two looks at the driver's stop request
CHUNK = 1 << 16   # bytes relayed at once


def _rank_start() -> None:
    """In the child between fork and exec: SIGINT and SIGTERM delivered (Ray's processes
    block SIGINT, and a blocked mask is inherited: the rank could not be stopped), and SIGTERM
    when the actor dies."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def child_env(job: dict, environ=os.environ) -> dict:
    """The rank's environment: the actor's (Horovod's variables among them), then what the
    driver forwards, without overriding Horovod's; huge pages set before the child starts."""
    env = dict(environ)
    for name, value in job["env"].items():
        if not name.startswith("HOROVOD_") or name not in env:
            env[name] = value
    paths = [p for p in (job["cwd"], job["env"].get("PYTHONPATH"), environ.get("PYTHONPATH"))
             if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(os.pathsep.join(paths).split(os.pathsep)))
    value = malloc.tunables(env)
    if value:
        env["GLIBC_TUNABLES"] = value
    return env


def run_rank(job: dict, hub) -> dict:
    """Run this actor's rank to its end; what the driver needs of it."""
    import ray

    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    host = socket.gethostname()
    answer = {"rank": rank, "host": host, "status": None, "signal": None, "result": None,
              "error": None}
    if not os.path.isdir(job["cwd"]):
        answer["error"] = (f"the driver's working directory {job['cwd']} does not exist on "
                           f"host {host}: start the driver from a directory every node sees")
        answer["status"] = 1
        return answer
    with tempfile.TemporaryDirectory(prefix="hvdtrain-ray-") as tmp:
        result_path = os.path.join(tmp, "result.pickle")
        if job["kind"] == "script":
            cmd = [sys.executable, job["script"], *job["argv"]]
        else:
            # The task's flags on the command line (what ps shows), the rest on stdin.
            cmd = [sys.executable, "-m", "hvdtrain.ray.worker", result_path, *job["argv"]]
        try:
            proc = subprocess.Popen(cmd, cwd=job["cwd"], env=child_env(job),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, preexec_fn=_rank_start)
        except OSError as e:
            answer["error"], answer["status"] = f"cannot start {cmd[0]} on {host}: {e}", 1
            return answer

        def relay(stream, name):
            fd = stream.fileno()
            while True:
                chunk = os.read(fd, CHUNK)
                if not chunk:
                    return
                hub.write.remote(rank, name, chunk)

        threads = [threading.Thread(target=relay, args=(proc.stdout, "out"), daemon=True),
                   threading.Thread(target=relay, args=(proc.stderr, "err"), daemon=True)]
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
                    stop = ray.get(hub.stop_signal.remote(), timeout=10)
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


def run_rank_elastic(job: dict, hub) -> dict:
    """``run_rank`` under Horovod's elastic driver: the answer goes to the hub (the driver
    reads the ranks' answers there), and a rank that did not end with 0 raises, so that the
    elastic driver counts its slot as failed."""
    answer = run_rank(job, hub)
    hub.answer.remote(answer)
    if answer["status"] != 0:
        raise RuntimeError(f"rank ended with status {answer['status']}")
    return answer["status"]
