"""``init()``: pick the backend (Horovod, or one process), start it, pin devices and thread
pools, and return this process's ``World``; ``current()``: the World it made."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from hvdtrain.base import timings
from hvdtrain.base.errors import LaunchError
from hvdtrain.base.launch import LAUNCHER_SIZE_VARS, launcher_size
from hvdtrain.distributed.horovod_setup import (
    _configure_devices,
    _horovod_defaults,
    _import_horovod,
)
from hvdtrain.distributed.horovod_world import HorovodWorld
from hvdtrain.distributed.world import World

_current: World | None = None


def current() -> World:
    """The World ``init()`` made in this process (started with backend auto if none yet)."""
    return _current if _current is not None else init()


def init(
    backend: str = "auto",
    num_workers: int | None = None,
    notice: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    elastic: bool = False,
) -> World:
    """Start the backend and return this process's World.

    backend: "auto" (Horovod if importable, else one process), "horovod" or "single".
    num_workers: the configured count; compared with the launcher's and warned about.
    elastic: the run needs Horovod's elastic driver (no fallback to one process).
    """
    with timings.phase("horovod_init"):  # its first import of Horovod's module: imports
        return _init(backend, num_workers, notice, elastic)


def _init(backend, num_workers, notice, elastic) -> World:
    launched = launcher_size()
    if backend == "single":
        if launched > 1:
            raise LaunchError(
                f"--backend single, but a launcher started {launched} processes: "
                f"they would train {launched} independent copies"
            )
        world = World()
    else:
        hvd, why = _import_horovod()
        if hvd is None:
            if backend == "horovod" or launched > 1 or elastic:
                raise LaunchError(
                    f"horovod cannot be imported ({why}), but "
                    + (
                        f"a launcher started {launched} processes: refusing to train "
                        f"{launched} independent copies"
                        if launched > 1
                        else "--backend horovod asks for it"
                        if backend == "horovod"
                        else "--elastic needs it"
                    )
                    + ("" if "scripts/setup.sh" in why else "; run scripts/setup.sh")
                )
            notice(
                f"hvdtrain: horovod unavailable ({why}); training in one process "
                "with the plain optimizer"
            )
            world = World()
        else:
            _horovod_defaults()
            hvd.init()
            world = HorovodWorld(hvd)
    _configure_devices(world.local_rank, world.local_size)
    global _current
    _current = world
    # Without a launcher there is no count to disagree with: one process is simply one.
    if (
        num_workers is not None
        and num_workers != world.size
        and world.is_chief
        and any(name in os.environ for name in LAUNCHER_SIZE_VARS)
    ):
        notice(
            f"hvdtrain: warning: --num-workers is {num_workers} but the launcher started "
            f"{world.size} process(es); training with world size {world.size}"
        )
    return world
