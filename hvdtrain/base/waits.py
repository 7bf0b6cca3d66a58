"""A call waited for at most so long: for the calls that can block forever when a peer is gone
(Horovod's shutdown in ``MPI_Finalize`` when the launcher's node is gone, a Ray call whose
daemons were killed)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def call_within(
    fn: Callable[[], object], seconds: float, name: str = "bounded-call"
) -> tuple[bool, BaseException | None]:
    """``fn()`` in a daemon thread named ``name``, waited for at most ``seconds``: (whether
    it ended in time, the exception it raised or None). A call still running is left to the
    process's exit (the thread is a daemon: it does not hold the process)."""
    errors: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (handed to the caller, who says it)
            errors.append(e)

    t = threading.Thread(target=call, name=name, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        return False, None
    return True, (errors[0] if errors else None)
