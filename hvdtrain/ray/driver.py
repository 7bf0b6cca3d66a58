"""The driver of a job on Ray: place the workers, start the ranks, relay their output, restart
the job from its newest checkpoint when the infrastructure failed, return rank 0's result.

One attempt: Horovod's ``RayExecutor`` reserves one placement-group bundle per worker (its CPUs,
its GPU with ``gpus_per_worker``) and starts a Horovod worker actor in each, with the Gloo
rendezvous set up; each actor starts its rank as a child process (``hvdtrain.ray.rank``). A
small ``Hub`` actor (no CPU) carries the ranks' output to this process and the driver's stop
request to the ranks.

An attempt ends as ``hvdtrain.jobs.outcome`` says (done, the user's error, started again from
the newest checkpoint up to ``max_restarts`` times, stopped); a worker actor or its node lost
counts as a rank lost.
"""

from __future__ import annotations

import atexit
import functools
import pickle
import threading
import time
from typing import Any

from hvdtrain.base.errors import EXIT_FAILED
from hvdtrain.base.waits import call_within
from hvdtrain.jobs.job import JobError
from hvdtrain.jobs.outcome import Console, Stop, failed, forwarded_env, outcome, restart_or_raise

PROG = "hvdtrain.ray"
RELEASE_SECONDS = 20.0
console = Console(PROG)
say = console.say


class RayJobError(JobError):
    """The job on Ray did not finish; ``status`` is what the command line exits with."""


@functools.cache  # one actor class per process, not one per attempt
def _hub_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class Hub:
        """The ranks' output on its way to the driver, and the driver's stop request."""

        def __init__(self):
            self.chunks, self.stop, self.ended = [], 0, []

        def write(self, rank, stream, chunk):
            self.chunks.append((rank, stream, chunk))

        def drain(self):
            chunks, self.chunks = self.chunks, []
            return chunks

        def request_stop(self, signum):
            self.stop = self.stop or int(signum)

        def stop_signal(self):
            return self.stop

        def answer(self, answer):
            self.ended.append(answer)

        def answers(self):
            return sorted(self.ended, key=lambda a: a["rank"])

    return Hub


def _hub():
    """A new hub, on this process's node: a node that dies takes this process with it, and a
    node lost but not yet known to be (Ray's health checks take seconds) would take the hub."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return (
        _hub_class()
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
        .remote()
    )


def bounded(fn, what: str, seconds: float = RELEASE_SECONDS) -> None:
    """``fn()`` in a thread, waited for at most ``seconds``: a Ray call whose daemons are gone
    (a local Ray instance killed with this process's group) blocks forever."""
    ended, error = call_within(fn, seconds, name="ray-release")
    if not ended or error is not None:
        say(
            f"{what}: {error if ended else 'no answer from Ray within %g s' % seconds} (left to Ray)"
        )


def _write(chunks) -> None:
    for _, stream, chunk in chunks:
        console.write(stream, chunk)


def _relay(hub, stop: Stop, running) -> None:
    """While ``running()`` (which waits a moment) is true: print the ranks' output as it
    comes, and hand this process's stop to the ranks, once. Then the last chunks the actors
    sent as their ranks ended."""
    import ray

    sent = False
    while running():
        _write(ray.get(hub.drain.remote()))
        if stop.signum and not sent:
            ray.get(hub.request_stop.remote(stop.signum))
            sent = True
    time.sleep(0.2)
    _write(ray.get(hub.drain.remote()))


def _attempt(job: dict, placement: dict, stop: Stop) -> list:
    """Run the job once on fresh workers; the ranks' answers (or why there are none)."""
    import ray
    from horovod.ray import RayExecutor

    from hvdtrain.ray.rank import run_rank

    hub = _hub()
    settings = RayExecutor.create_settings(
        timeout_s=placement["timeout_s"], placement_group_timeout_s=placement["timeout_s"]
    )
    executor = RayExecutor(
        settings,
        num_workers=placement["num_workers"],
        cpus_per_worker=placement["cpus_per_worker"],
        use_gpu=placement["gpus_per_worker"] > 0,
        gpus_per_worker=placement["gpus_per_worker"] or None,
    )
    try:
        try:
            executor.start()
        except TimeoutError:  # Horovod's placement group wait
            raise RayJobError(_no_room(placement)) from None
        workers = executor.adapter.workers
        hosts = ray.get([w.hostname.remote() for w in workers])
        say(f"{len(hosts)} workers: " + ", ".join(f"rank {r} on {h}" for r, h in enumerate(hosts)))
        refs = executor.run_remote(run_rank, args=[job, hub])
        pending = list(refs)

        def running():
            nonlocal pending
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            return bool(pending)

        _relay(hub, stop, running)
        answers = []
        for rank, ref in enumerate(refs):
            try:
                answers.append(ray.get(ref))
            except (
                ray.exceptions.RayActorError,
                ray.exceptions.WorkerCrashedError,
                ray.exceptions.NodeDiedError,
            ) as e:
                answers.append(
                    failed(rank, hosts[rank], None, f"its Ray worker was lost ({type(e).__name__})")
                )
        return answers
    finally:

        def release():
            for worker in getattr(getattr(executor, "adapter", None), "workers", None) or []:
                ray.kill(worker)  # now, not when Python collects the handles
            executor.shutdown()  # its placement group
            ray.kill(hub)

        bounded(release, "releasing the workers")


def _attempt_elastic(job: dict, placement: dict, stop: Stop) -> list:
    """The job under Horovod's elastic driver on Ray (``ElasticRayExecutor``): between
    ``min_workers`` and ``max_workers`` ranks, one per free slot of the nodes Ray has. A rank
    or node lost: the others reset and go on from their last commit (hvdtrain's ``--elastic``);
    a node that returns (after Horovod's cool-down of its address) joins at the next commit.
    The answers are the ranks' that ended by themselves."""
    import ray
    from horovod.ray import ElasticRayExecutor

    from hvdtrain.ray.rank import run_rank_elastic

    hub = _hub()
    settings = ElasticRayExecutor.create_settings(
        min_num_proc=placement["min_workers"],
        max_num_proc=placement["max_workers"],
        elastic_timeout=placement["timeout_s"],
        timeout_s=placement["timeout_s"],
        cooldown_range=placement["cooldown"],
    )
    executor = ElasticRayExecutor(
        settings,
        use_gpu=placement["gpus_per_worker"] > 0,
        cpus_per_slot=placement["cpus_per_worker"],
        gpus_per_slot=placement["gpus_per_worker"] or None,
    )
    failure = []

    def drive():
        try:
            executor.start()
            executor.run(functools.partial(run_rank_elastic, job, hub))
        except BaseException as e:  # noqa: BLE001 (read below, with the ranks' answers)
            failure.append(e)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    try:
        _relay(hub, stop, lambda: (thread.join(0.2), thread.is_alive())[1])
        answers = ray.get(hub.answers.remote())
    finally:
        bounded(lambda: ray.kill(hub), "releasing the hub")
    if not answers:
        why = f"{failure[0]}" if failure else "no rank ended"
        answers = [failed(0, "?", EXIT_FAILED, f"the elastic job failed: {why}")]
    return answers


def _no_room(placement: dict) -> str:
    import ray

    free = ray.available_resources()
    want = f"{placement['cpus_per_worker']} CPU" + (
        f" and {placement['gpus_per_worker']} GPU" if placement["gpus_per_worker"] else ""
    )
    return (
        f"the Ray cluster has no room for {placement['num_workers']} workers of {want} "
        f"each within {placement['timeout_s']} s (free now: "
        f"{free.get('CPU', 0):g} CPU, {free.get('GPU', 0):g} GPU)"
    )


def run_job(job: dict, placement: dict, address: str | None, max_restarts: int) -> Any:
    """Run ``job`` on the Ray cluster at ``address`` (None: the one Ray finds, or a new one on
    this machine) until it finishes; rank 0's result."""
    import ray

    if not ray.is_initialized():
        try:
            ray.init(
                address=address,
                log_to_driver=False,
                configure_logging=True,
                logging_level="warning",
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayJobError(
                f"cannot connect to the Ray cluster{f' at {address}' if address else ''}: {e}"
            ) from None
        started = True  # this process connected: it disconnects, within a bound
    else:
        started = False
    job = dict(job, env={**forwarded_env(), **job.get("env", {})})
    try:
        return _run(job, placement, max_restarts)
    finally:
        if started:
            bounded(ray.shutdown, "disconnecting from Ray")
            atexit.unregister(ray.shutdown)  # done, or hung: not again at exit


def _run(job: dict, placement: dict, max_restarts: int) -> Any:
    with Stop(console) as stop:
        for attempt in range(max_restarts + 1):
            attempt_fn = _attempt_elastic if placement.get("min_workers") else _attempt
            answers = attempt_fn(job, placement, stop)
            status, why, retry = outcome(answers, bool(stop.signum))
            if status == 0:
                data = next((a["result"] for a in answers if a["result"] is not None), None)
                return pickle.loads(data) if data is not None else None
            restart_or_raise(
                status, why, retry, bool(stop.signum), attempt, max_restarts, console, RayJobError
            )
