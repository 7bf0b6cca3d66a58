"""The driver's side of a job on a cluster front: its lines, its SIGINT and SIGTERM, the
environment it forwards to the ranks, and what the ranks' answers mean for the job.

An attempt's answers mean:
- every rank with 0: the job is done, rank 0's result is returned;
- a rank with 1 or 2 (the user's: a bad flag, a data file, a diverged loss): that status, after
  the rank's own line; never retried;
- a rank with a status after which the same command resumes (69 a rank died or froze, 73 the
  run directory still held, 74 the storage failed, 75 preempted), a rank's process or machine
  lost, a rank killed by a signal: the job is started again from its newest checkpoint (the
  front decides how often); after the last restart, the attempt's status;
- the driver stopped (SIGINT, SIGTERM): the signal went to every rank, which saved at a step
  they agreed on and exited 75; so does the driver.
"""

from __future__ import annotations

import os
import signal
import sys

from hvdtrain.base.errors import EXIT_FAILED, EXIT_PEER_LOST, EXIT_PREEMPTED, RETRIED

# The driver's environment the ranks get (the cluster's processes have the environment their
# node's daemon started with): hvdtrain's and its frameworks' switches, the trackers' settings.
FORWARDED = (
    "HVDTRAIN_",
    "TF_",
    "KERAS_",
    "MLFLOW_",
    "WANDB_",
    "NCCL_",
    "HOROVOD_",
    "OMP_",
    "GLIBC_TUNABLES",
    "PYTHONPATH",
)
# Horovod's variables that describe one launch: the cluster's integration sets them per rank.
LAUNCH_VARS = (
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
    "HOROVOD_HOSTNAME",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_CONTROLLER",
    "HOROVOD_CPU_OPERATIONS",
    "HOROVOD_GLOO_IFACE",
    "HOROVOD_ELASTIC",
)


def forwarded_env(environ=os.environ) -> dict:
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED) and k not in LAUNCH_VARS}


class Console:
    """The driver's stdout and stderr: the ranks' output relayed as it comes, and the driver's
    own lines (``PROG: ...``), each starting on a new line when the ranks' last output ended
    mid-line (a progress bar, a write cut in two)."""

    def __init__(self, prog: str):
        self.prog = prog
        self.mid_line = {"out": False, "err": False}

    def say(self, line: str) -> None:
        sys.stderr.write(f"{chr(10) if self.mid_line['err'] else ''}{self.prog}: {line}\n")
        sys.stderr.flush()
        self.mid_line["err"] = False

    def write(self, stream: str, chunk: bytes) -> None:
        if chunk:
            self.mid_line[stream] = not chunk.endswith(b"\n")
        out = sys.stdout if stream == "out" else sys.stderr
        try:
            out.buffer.write(chunk)
        except AttributeError:  # a stream without bytes (a notebook's): text
            out.write(chunk.decode(errors="replace"))
        out.flush()


class Stop:
    """The driver's SIGINT and SIGTERM while a job runs: remembered (``signum``), said once,
    then sent to the ranks by the front."""

    def __init__(self, console: Console):
        self.console, self.signum, self._old = console, 0, {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._on)
            except ValueError:  # not the main thread (a notebook's worker thread): no handler
                pass
        return self

    def _on(self, signum, frame):
        if not self.signum:
            self.signum = signum
            self.console.say(
                f"{signal.Signals(signum).name}: stopping the ranks (they save a checkpoint first)"
            )

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)
        return False


def failed(rank: int, host, status, error: str) -> dict:
    """A rank's answer when the rank could not give one (its process lost; the job failed as
    a whole: ``host`` None)."""
    return {
        "rank": rank,
        "host": host,
        "status": status,
        "signal": None,
        "result": None,
        "error": error,
    }


def outcome(answers: list, stopped: bool) -> tuple:
    """(status, why, retry): what an attempt's answers mean for the job."""
    statuses = [a["status"] for a in answers]
    if all(s == 0 for s in statuses):
        return 0, "", False
    user = [a for a in answers if a["status"] in (1, 2) and not a.get("error")]
    if user:  # the rank said its line; the lowest rank's status
        return user[0]["status"], "", False
    errors = [a for a in answers if a.get("error") and a["status"] is not None]
    if errors:
        return errors[0]["status"], f"rank {errors[0]['rank']}: {errors[0]['error']}", False
    if stopped:  # the ranks' (75 once they saved); a rank stopped before it trained: its own
        first = answers[0]["status"]
        return (first if first not in (None, 0) else EXIT_PREEMPTED), "", False
    lost = [a for a in answers if a["status"] is None or a["signal"]]
    if lost:
        a = lost[0]
        why = (
            f"rank {a['rank']} on {a['host']} was killed by {a['signal']}"
            if a["signal"]
            else f"rank {a['rank']} on {a['host']}: {a['error']}"
            if a["host"]
            else a["error"]
        )  # the job failed as a whole: no rank to name
        return EXIT_PEER_LOST, why, True
    retried = [s for s in statuses if s in RETRIED]
    if retried:
        return retried[0], f"the ranks ended with status {retried[0]}", True
    odd = next(a for a in answers if a["status"] != 0)
    return (
        odd["status"] or EXIT_FAILED,
        (f"rank {odd['rank']} on {odd['host']} ended with status {odd['status']}"),
        False,
    )


def restart_or_raise(
    status: int,
    why: str,
    retry: bool,
    stopped: bool,
    attempt: int,
    max_restarts: int,
    console: Console,
    error: type,
) -> None:
    """After an attempt that did not finish: say the restart and return, or raise ``error``."""
    if retry and not stopped and attempt < max_restarts:
        console.say(
            f"{why}: the job starts again from its newest checkpoint "
            f"(restart {attempt + 1} of {max_restarts})"
        )
        return
    if retry and attempt == max_restarts and max_restarts:
        why = f"{why}, after {max_restarts} restarts"
    raise error(why, status, said=not why)
