"""One rank of a job on Spark: what ``horovod.spark.run`` calls in each Horovod process it
started for a Spark task.

That process does not train: it starts the rank as a process of its own
(``hvdtrain.jobs.rank``), whose output goes to this process's stdout and stderr (Horovod's
task service relays them to the driver, each line after ``[RANK]<stdout>:``), and asks the
driver's stop service (``hvdtrain.spark.driver.StopService``) every quarter second whether the
driver was stopped (saying its rank and host). Imports only the standard library: this process must not import
TensorFlow (it would hold the GPU the child needs).
"""

from __future__ import annotations

import os
import socket

from hvdtrain.base.launch import launcher_rank
from hvdtrain.jobs.rank import run_rank as run_child

STOP_TIMEOUT = 5.0  # seconds for one question to the driver's stop service
STOP_MISSES = 8  # questions in a row without an answer: the driver is gone (2 s)


class StopClient:
    """The driver's answer to "stop?": 0, or the signal to stop with. Raises once the driver
    has not answered ``STOP_MISSES`` times in a row (the rank then stops as if asked)."""

    def __init__(self, address):
        self.host, self.port, self.key = address
        self.misses = 0
        # Who asks: the driver prints where each rank runs once all have asked.
        self.asker = f"{launcher_rank()} {socket.gethostname()}"

    def __call__(self) -> int:
        try:
            with socket.create_connection((self.host, self.port), timeout=STOP_TIMEOUT) as s:
                s.sendall(f"{self.key} {self.asker}\n".encode())
                answer = s.makefile("rb").readline()
            signum = int(answer)
        except (OSError, ValueError):
            self.misses += 1
            if self.misses >= STOP_MISSES:
                raise
            return 0
        self.misses = 0
        return signum


def _write(stream: str, chunk: bytes) -> None:
    fd = 1 if stream == "out" else 2
    while chunk:
        chunk = chunk[os.write(fd, chunk) :]


def run_rank(job: dict) -> dict:
    """Run this Spark task's rank to its end; what the driver needs of it."""
    return run_child(job, _write, StopClient(job["stop"]))
