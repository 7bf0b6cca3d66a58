"""Where one ``hk.fit`` stands in its steps, and when a step must stop: the fit driver's
counters (``FitCounters``), the check for a SIGTERM on any rank (``StopCheck``: in the flags
that ride in the updates, or a host allreduce) and the call boundaries that pass a multiple
of a count of steps (``passed``: stop checks, checkpoints).
"""

from __future__ import annotations

import dataclasses

from hvdtrain.distributed.optimizer import StopFlags
from hvdtrain.engine.run import Run
from hvdtrain.fit.script import steps_per_execution

# Steps between two checks for a SIGTERM on any rank. A host allreduce every step halved
# fit's throughput against Horovod's own Keras wrapper, and every 10 steps still cost a
# quarter of it at steps_per_execution 1 (a round trip per 10 steps of a small model). With
# calls shorter than this, the flag rides in the gradients' allreduce instead
# (optimizer.StopFlags), and a check reads it: no round trip of its own.
STOP_CHECK_EVERY = 10
"""Steps between two checks for a SIGTERM on any rank, at most: a preempted ``hk.fit`` stops
every rank within that many steps of the signal (at the end of a compiled call when a call
is longer)."""


@dataclasses.dataclass
class FitCounters:
    """Where one ``hk.fit`` stands, counted from Keras' events (every rank counts the same)."""

    epoch: int = 0  # the epoch in training (Keras' index, from 0)
    step: int = 0  # the Keras steps of it done
    started: int = 0  # the step it started from in this process (> 0 after a resume)
    first_step: int = 0  # the step the next epoch starts from (a resume inside it: its own)
    micro: int = 0  # the Keras steps (micro-batches when accumulating) since the run began
    global_step: int = 0  # the updates since the run began (the run's step)
    epochs_done: int = 0  # the epochs finished
    tick: float = 0.0  # when the epoch's steps began (time.perf_counter)
    stop_pending: bool = False  # a SIGTERM reached a rank: stop at the next update's end
    save_pending: bool = False  # a checkpoint is due at the next update's end


class StopCheck:
    """Did SIGTERM reach any rank? The fit driver asks after each call (``any``)."""

    def __init__(self, run: Run):
        self.run_ = run
        # optimizer.StopFlags, when the stop flag rides in the updates: the flags' count and
        # the updates that carried them at the last question; whether any update carried them
        self.flags: StopFlags | None = None
        self.stop_base, self.carried, self.rode = 0.0, 0, False

    def attach(self, model, optimizer) -> None:
        """After the broadcast: the stop flags ride in ``optimizer``'s updates when calls are
        shorter than STOP_CHECK_EVERY steps (a longer call takes one host check per call,
        which decides at the call's end rather than one call later)."""
        if not self.run_.world.alone and steps_per_execution(model) < STOP_CHECK_EVERY:
            self.flags = StopFlags.attach(optimizer)
            self.stop_base, self.carried = self.flags.read()

    def raise_local(self) -> None:
        """Before a call: a SIGTERM seen here rides in the call's updates to every rank."""
        if self.flags is not None and self.run_.stop_requested:
            self.flags.raise_local()  # this call's updates tell every rank

    def any(self, step: int, done: int) -> bool:
        """All ranks, after a call of ``done`` steps ending at the epoch's ``step``: did
        SIGTERM reach any rank? Asked when the call passes a multiple of STOP_CHECK_EVERY
        steps (all ranks count the same steps, so all ask at the same call and decide the
        same); the epoch's end asks in the metric sums' allreduce.

        The answer is in the flags that rode in the updates since the last question (their
        sums over ranks: the same on every rank); a call of micro-batches inside an update
        carries none, and a later update's will tell. When they never rode (Horovod's own
        DistributedOptimizer, a train function traced before they were attached), a
        one-number host allreduce asks the ranks: a round trip of its own."""
        if not passed(step, done, STOP_CHECK_EVERY):
            return False
        if self.flags is not None:
            stop, carried = self.flags.read()
            if carried > self.carried:  # updates since the last question carried the flags
                self.carried, self.rode = carried, True
                return stop > self.stop_base
            if self.rode:  # they ride, in updates only
                return False
        return self.run_.should_stop()


def passed(step: int, done: int, every: int) -> bool:
    """Did the last ``done`` steps, ending at ``step``, reach a multiple of ``every``?"""
    return bool(every) and step // every > (step - done) // every
