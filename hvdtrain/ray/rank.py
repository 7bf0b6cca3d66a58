"""One rank of a job on Ray: what runs in each Horovod worker actor that ``RayExecutor`` placed.

The actor starts the rank as a process of its own (``hvdtrain.jobs.rank``): its output goes, as
it comes, to the driver's ``Hub`` actor (the driver prints it), and the driver's stop request
is read there. Imports only the standard library and Ray's: the actor has Horovod and Ray
loaded already, and must not import TensorFlow (it would hold the GPU the child needs).
"""

from __future__ import annotations

import os

from hvdtrain.jobs.rank import run_rank as run_child


def run_rank(job: dict, hub) -> dict:
    """Run this actor's rank to its end; what the driver needs of it."""
    import ray

    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    return run_child(
        job,
        lambda stream, chunk: hub.write.remote(rank, stream, chunk),
        lambda: ray.get(hub.stop_signal.remote(), timeout=10),
    )


def run_rank_elastic(job: dict, hub) -> dict:
    """``run_rank`` under Horovod's elastic driver: the answer goes to the hub (the driver
    reads the ranks' answers there), and a rank that did not end with 0 raises, so that the
    elastic driver counts its slot as failed."""
    answer = run_rank(job, hub)
    hub.answer.remote(answer)
    if answer["status"] != 0:
        raise RuntimeError(f"rank ended with status {answer['status']}")
    return answer["status"]
