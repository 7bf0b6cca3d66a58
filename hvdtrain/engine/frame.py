"""A run's frame on this rank: the watchdog, SIGTERM and SIGINT, errors on every rank together.

``RunFrame`` is the part of ``run.Run`` that is not the order of its calls: entering starts
the watchdog (no rank waits forever on a dead or frozen peer); SIGTERM and SIGINT set a flag
that every rank's driver reduces (``should_stop``), so all stop after the same step
(``preempt``: ``Preempted``, exit 75); rank 0's storage errors and the user's exceptions are
raised on every rank at once (``rank0_writes``, ``user``); leaving ends the watchdog as the
run ended (normally, together, or on this rank alone: ``stop_watching``).
"""

from __future__ import annotations

import signal
from typing import Literal, TypeVar

from hvdtrain.base import timings
from hvdtrain.base.config import Config
from hvdtrain.base.errors import (
    Error,
    Preempted,
    RankError,
    StorageError,
    TaskError,
    error_line,
    first_line,
    user_code,
)
from hvdtrain.distributed.world import World
from hvdtrain.engine.report import Reporter
from hvdtrain.engine.rundir import RunDir
from hvdtrain.engine.watchdog import Watchdog

# The signals that preempt a run: a checkpoint at a step every rank agrees on, exit 75.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
F = TypeVar("F", bound="RunFrame")


class RunFrame:
    """The watchdog, the stop signals and every-rank errors of one run (``run.Run``'s base).

    Args:
        world: the ranks of the run.
        config: the run's settings (``elastic``, ``peer_timeout``).
    """

    out: Reporter  # set by Run: rank 0's console lines and files
    dir: RunDir

    def __init__(self, world: World, config: Config):
        self.world, self.config = world, config
        # Elastic runs: nothing before Horovod's driver may be a collective (a worker that
        # joins later runs the setup alone while the others wait inside the driver's sync).
        self.collective = not config.elastic
        self.stop_requested = False
        self._handlers: dict = {}  # the signal handlers the run replaced while it trains
        self.stop_signal: str | None = None  # the name of the one that stopped it

    # --- the run's frame: watchdog, SIGTERM, errors ---------------------------------------------
    @timings.timed("agreement")  # the watchdog's handshake
    def __enter__(self: F) -> F:
        # Elastic runs survive a lost worker by design: Horovod's driver, not the watchdog, acts.
        self.dog = Watchdog(
            self.world, 0 if self.config.elastic else self.config.peer_timeout
        ).start()
        return self

    def __exit__(self, kind, e, tb) -> Literal[False]:
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers = {}
        self.out.release()
        try:
            stop_watching(self.dog, self.world, e)
        finally:  # after the watchdog: the other ranks need not wait for the trackers
            self.out.close_trackers(e)
        return False

    def _on_signal(self, signum, frame) -> None:
        if not self.stop_requested:
            self.stop_signal = signal.Signals(signum).name
        self.stop_requested = True

    def rank0_writes(self, fn, *args):
        """Rank 0's ``fn(*args)`` (the run directory's files); its ``StorageError`` (disk
        full, read-only, ...) raised on every rank at once, so all stop together with one
        line (a one-number allreduce: the others wait for the write; the message is
        broadcast only when there is one)."""
        value, error = None, None
        try:
            value = fn(*args)
        except StorageError as e:
            error = str(e)
        if self.collective and self.world.any_true(error is not None):
            error = self.world.broadcast_object(error)
        if error is not None:
            raise StorageError(error)
        return value

    def agree(self, fn, catch, merge=None):
        """``fn()`` on every rank, failing on all if it failed on one (``World.agree``); alone
        in elastic runs."""
        return self.world.agree(fn, catch=catch, merge=merge) if self.collective else fn()

    def user(self, what: str, fn, *args, catch=()):
        """The user's ``fn(*args)`` on every rank: an exception from it (or ``catch``) on any
        rank stops every rank with one line naming it and the user's file and line."""

        def call():
            with user_code(what):
                return fn(*args)

        return self.agree(call, catch=(TaskError,) + tuple(catch), merge=TaskError)

    def catch_signals(self) -> None:
        """From here on SIGTERM and SIGINT stop the run at a step boundary instead of
        killing (interrupting) the process."""
        for signum in STOP_SIGNALS:
            self._handlers.setdefault(signum, signal.signal(signum, self._on_signal))

    def should_stop(self) -> bool:
        """All ranks: did SIGTERM or SIGINT reach any rank? (A host allreduce of its own: the
        Task loop puts this flag in the step's gradient round instead.)"""
        return self.world.allreduce_sum([float(self.stop_requested)])[0] > 0

    def preempt(self, global_step: int) -> None:
        """After the checkpoint of a SIGTERM'd (SIGINT'd) step: every rank stops here."""
        # The process is ending with 75: a second SIGTERM (srun sends its own when the job
        # is cancelled) or Ctrl-C must not turn that into a death by signal (143) or an
        # interrupt, now or on the way out, so they stay ignored.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        self._handlers = {}
        # Nobody exits (and gets the job killed) before the save; the signal the ranks saw.
        seen = [
            s
            for s in self.world.allgather_object(self.stop_signal if self.stop_requested else None)
            if s
        ] or ["SIGTERM"]
        stop = Preempted(
            f"stopped by {seen[0]} at step {global_step}; checkpoint saved in "
            f"{self.dir.checkpoints}; run the same command to resume"
        )
        stop.world = self.world  # report(): no rank exits before rank 0 has said the line
        raise stop


def stop_watching(dog: Watchdog, world: World, e: BaseException | None) -> None:
    """End the watchdog as the run ended: normally, together, or on this rank alone."""
    if e is None or getattr(e, "together", False):
        dog.close()  # every rank ended here together; nobody waits for anyone
    elif isinstance(e, Exception) and "Horovod" in str(e):
        # A collective failed because a peer is gone; the watchdog, which names that peer,
        # usually ends this process first. When Horovod's error wins the race, give the
        # watchdog's verdict a moment to arrive, then say it in one line.
        dog.await_verdict(5.0)
        dog.abort(error_line(e))
        raise RankError(
            f"rank {world.rank}: a collective failed (a peer is gone?): {first_line(str(e))}"
        ) from None
    else:
        # This rank alone: stop the others too. Rank 0 says the line, once (for another
        # rank's error, the verdict it relays; for its own, its report).
        if dog.abort(one_rank_line(e, world.rank)) and isinstance(e, Error):
            e.said = True


def one_rank_line(e: BaseException, rank: int) -> str:
    """The line that says one rank's error: its own text when it names the rank (a failed
    step's), else ``rank R failed: ...``."""
    text = str(e) if isinstance(e, Error) else error_line(e)
    return text if f"on rank {rank}" in text else f"rank {rank} failed: {text}"
