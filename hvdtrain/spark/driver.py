"""The driver of a job on Spark: start the ranks as Spark tasks, relay their output, restart
the job from its newest checkpoint when the infrastructure failed, return rank 0's result.

One attempt is one ``horovod.spark.run``: Spark runs one task per rank (one task slot each);
Horovod starts a process in each task and hands it the rank's function
(``hvdtrain.spark.rank.run_rank``), which starts the rank as a process of its own. Horovod's
task services relay the ranks' output to this process. A small TCP service here
(``StopService``) answers the ranks' "stop?" with this process's SIGINT or SIGTERM.

An attempt ends as ``hvdtrain.jobs.outcome`` says (done, the user's error, started again from
the newest checkpoint up to ``max_restarts`` times, stopped). ``horovod.spark.run`` raising
(a rank's process, its executor or its machine lost: Horovod ends the other ranks) counts as a
rank lost; no room for the ranks within ``start_timeout`` ends the job with one line.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import secrets
import socketserver
import sys
import threading
from typing import Any

from hvdtrain.base.errors import EXIT_FAILED
from hvdtrain.jobs.job import JobError
from hvdtrain.jobs.outcome import Console, Stop, failed, forwarded_env, outcome, restart_or_raise

PROG = "hvdtrain.spark"
STOP_GRACE = 120.0  # seconds the ranks have to save and end after a stop, before a cancel
console = Console(PROG)
say = console.say


class SparkJobError(JobError):
    """The job on Spark did not finish; ``status`` is what the command line exits with."""


class StopService(socketserver.ThreadingTCPServer):
    """Answers each rank's question (a line: the job's key, the rank, its host) with the
    signal the ranks stop with: 0 while the driver runs. ``hosts``: {rank: host} of the ranks
    that asked since ``hosts`` was last cleared (one attempt's)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, stop: Stop):
        self.stop, self.key, self.hosts = stop, secrets.token_hex(16), {}

        class Answer(socketserver.StreamRequestHandler):
            timeout = 5

            def handle(inner):
                try:
                    key, rank, host = inner.rfile.readline().decode().split()
                    rank = int(rank)
                except (OSError, UnicodeDecodeError, ValueError):
                    return
                if secrets.compare_digest(key, self.key):
                    self.hosts.setdefault(rank, host)
                    inner.wfile.write(f"{self.stop.signum}\n".encode())

        super().__init__(("0.0.0.0", 0), Answer)
        self.port = self.server_address[1]
        self.thread = threading.Thread(target=self.serve_forever, args=(0.2,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
        return False


class _Relay(io.TextIOBase):
    """A rank's stdout or stderr as Horovod's task service streams it to this process (text,
    each line after ``[RANK]<stdout>:``): printed as it comes. Without it the ranks' output
    would stay in their executors' logs."""

    def __init__(self, stream: str):
        self.stream = stream

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        console.write(self.stream, text.encode(errors="replace"))
        return len(text)


def session(master: str | None):
    """(SparkSession, whether this process made it): the active one, else a new one on
    ``master`` (default: what spark-submit or Spark's configuration say, else local)."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        have = active.sparkContext.master
        if master and master != have:
            raise SparkJobError(
                f"master={master}: this process's Spark session runs on "
                f"{have}; stop it first or leave the master out",
                2,
            )
        return active, False
    # The executors run this Python unless told otherwise (Spark's default is the first
    # python3 on their PATH, which may lack hvdtrain): the venv at the same path everywhere.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("hvdtrain").config(
        "spark.ui.showConsoleProgress", "false"
    )  # its bar would cut the ranks' lines
    if master:
        builder = builder.master(master)
    try:
        return builder.getOrCreate(), True
    except Exception as e:  # noqa: BLE001 (Java missing, a master unreachable: py4j's)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SparkJobError(
            f"cannot start a Spark session{f' on {master}' if master else ''}: {first}"
        ) from None


def _no_room(error: Exception, launch: dict, sc) -> str:
    return (
        f"Spark did not start {launch['num_proc']} tasks for the ranks within "
        f"{launch['start_timeout']} s (each rank is one task of one core; the "
        f"application has {sc.defaultParallelism} cores now): {error}"
    )


def _attempt(job: dict, launch: dict, stop: Stop, service: StopService, sc) -> list:
    """Run the job once as fresh Spark tasks; the ranks' answers (or why there are none)."""
    import horovod.spark
    from horovod.runner.common.util.timeout import TimeoutException

    from hvdtrain.spark.rank import run_rank

    returned, failure = [], []

    def drive():
        try:
            returned.extend(
                horovod.spark.run(
                    run_rank,
                    args=(job,),
                    num_proc=launch["num_proc"],
                    start_timeout=launch["start_timeout"],
                    use_mpi=launch["use_mpi"],
                    use_gloo=not launch["use_mpi"],
                    env=dict(job["env"]),
                    verbose=0,
                    stdout=_Relay("out"),
                    stderr=_Relay("err"),
                )
            )
        except BaseException as e:  # noqa: BLE001 (read below)
            failure.append(e)

    service.hosts.clear()
    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    waited, placed = 0.0, False
    while thread.is_alive():
        thread.join(0.2)
        hosts = dict(service.hosts)
        if not placed and len(hosts) == launch["num_proc"]:
            say(
                f"{len(hosts)} ranks: "
                + ", ".join(f"rank {r} on {h}" for r, h in sorted(hosts.items()))
            )
            placed = True
        if stop.signum:
            waited += 0.2
            if waited >= STOP_GRACE:  # the ranks did not end after the stop: end their tasks
                say(
                    f"the ranks did not end within {STOP_GRACE:g} s of the stop: cancelling "
                    "their Spark tasks"
                )
                sc.cancelAllJobs()
                thread.join(30)
                break
    if returned:
        return returned
    error = failure[0] if failure else RuntimeError("no answer from the Spark tasks")
    if isinstance(error, TimeoutException):
        raise SparkJobError(_no_room(error, launch, sc))
    return [failed(0, None, None, _why(error))]


def _why(error: BaseException) -> str:
    """One line for what ended an attempt that returned no answers."""
    text = str(error)
    lost = re.search(r"Process name: (\S+)\s+Exit code: (\S+)", text)
    if lost:  # Horovod's gloo launcher: a rank's Horovod process ended without an answer
        return (
            f"rank {lost.group(1)}'s process ended before its rank did (its Spark task, "
            "executor or machine lost)"
        )
    first = (text.strip().splitlines() or [type(error).__name__])[0]
    return f"the Spark job failed ({type(error).__name__}: {first})"


def run_job(job: dict, launch: dict, max_restarts: int, spark=None) -> Any:
    """Run ``job`` as Spark tasks (``spark``: a SparkSession; None: the active one, else a new
    one on ``launch["master"]``) until it finishes; rank 0's result."""
    made = False
    if spark is None:
        spark, made = session(launch.get("master"))
    sc = spark.sparkContext
    if not launch.get("num_proc"):
        launch = dict(launch, num_proc=sc.defaultParallelism)
    job = dict(job, env={**forwarded_env(), **job.get("env", {})})
    previous_hook = threading.excepthook

    def quiet_spark_thread(args):
        # Horovod's thread that runs the Spark job raises when the job is cancelled (a rank
        # lost, no room): the driver says why in one line, without its Java traceback.
        if args.thread is not None and "run_spark" in args.thread.name:
            return
        previous_hook(args)

    threading.excepthook = quiet_spark_thread
    try:
        with Stop(console) as stop, StopService(stop) as service:
            job["stop"] = (sc.getConf().get("spark.driver.host"), service.port, service.key)
            for attempt in range(max_restarts + 1):
                answers = _attempt(job, launch, stop, service, sc)
                status, why, retry = outcome(answers, bool(stop.signum))
                if status == 0:
                    data = next((a["result"] for a in answers if a["result"] is not None), None)
                    return pickle.loads(data) if data is not None else None
                restart_or_raise(
                    status,
                    why,
                    retry,
                    bool(stop.signum),
                    attempt,
                    max_restarts,
                    console,
                    SparkJobError,
                )
    finally:
        threading.excepthook = previous_hook
        if made:
            spark.stop()
    raise SparkJobError("no attempt ran", EXIT_FAILED)  # max_restarts < 0: refused before
