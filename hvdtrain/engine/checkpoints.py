"""A run's checkpoints: rank 0 finds the newest valid one (refused when the settings that
define the run differ, named as the user sets them), loads it into the model's and the
optimizer's variables, and saves them with the data position and the epoch's metric sums so
far. The file format is ``checkpoint_file``."""

from __future__ import annotations

import time

import numpy as np

from hvdtrain.base import compat
from hvdtrain.base.config import Config
from hvdtrain.base.errors import CheckpointError, shown
from hvdtrain.distributed.world import Progress, World
from hvdtrain.engine import checkpoint_file
from hvdtrain.engine.fronts import CommandLine, FitScript


class Checkpoints:
    """A run's checkpoints: rank 0 finds, checks, loads and writes them (``checkpoint_file``
    is the file format); the other ranks get what rank 0 read through the ``Run``.
    ``front`` (``fronts``; a command line's by default) names the settings in refusals as
    the user sets them."""

    def __init__(
        self,
        world: World,
        config: Config,
        directory: str,
        notice,
        front: CommandLine | FitScript | None = None,
    ):
        self.world, self.config, self.directory, self.notice = world, config, directory, notice
        self.front = front if front is not None else CommandLine("")

    def steps(self) -> list:
        """The global steps of the checkpoints on disk, newest first."""
        return [step for step, _ in checkpoint_file.list_checkpoints(self.directory)]

    def find(self, defining: dict):
        """Rank 0: the newest valid checkpoint's (meta, arrays, path), or None to start
        fresh; refused when ``defining`` (the settings that define the run) differs."""
        if not self.world.is_chief:
            return None
        found = checkpoint_file.list_checkpoints(self.directory)
        run_dir, no_resume, resume = self.front.run_dir, self.front.no_resume, self.front.resume
        if self.config.resume is False and found:
            raise CheckpointError(
                f"{self.directory} holds {len(found)} checkpoint(s) and {no_resume} was given: "
                f"choose a new {run_dir}, or drop {no_resume} to continue"
            )
        state = checkpoint_file.load_latest(self.directory, self.notice) if found else None
        if state is None and self.config.resume:
            raise CheckpointError(f"{resume}: no checkpoint in {self.directory}")
        if state is not None:
            saved, now = dict(state[0]["run"]), dict(defining)
            saved.update(saved.pop("settings", {}))  # the driver's settings, flattened
            now.update(now.pop("settings"))
            # Named as the user sets them (a fit script: the optimizer's learning_rate),
            # with the values as written (a float32 variable's 0.1, not 0.10000000149...).
            changed = [
                f"{self.front.argument(k) if k != 'task' else 'task'} "
                f"{shown(saved.get(k))} -> {shown(v)}"
                for k, v in now.items()
                if k in saved and saved[k] != v
            ]
            if changed:
                raise CheckpointError(
                    f"{state[2]} was made with other settings ({'; '.join(changed)}): resume "
                    f"with the same settings, or choose a new {run_dir}"
                )
        return state

    def load(self, found, state: list) -> dict | None:
        """Rank 0: put a found checkpoint into ``state``; return the progress fields."""
        if found is None or not self.world.is_chief:
            return None
        meta, arrays, path = found
        if len(arrays) != len(state) + 1 or any(
            tuple(a.shape) != tuple(v.shape) for a, v in zip(arrays, state)
        ):
            raise CheckpointError(f"{path}: its variables do not match this model")
        for variable, value in zip(state, arrays):
            variable.assign(value)
        sums = arrays[-1]  # an epoch end's sums are zero (hvdtrain <= 0.2's fit: empty)
        return {
            "epoch": meta["epoch"],
            "offset": meta["offset"],
            "sums": sums.tolist() if sums.size and sums.any() else None,
            "last_record": meta.get("last_record"),
            "path": path,
        }

    def save(
        self,
        progress: Progress,
        partial_sums,
        state: list,
        global_batch: int,
        global_step: int,
        record: dict,
        last_record,
    ) -> None:
        """Rank 0 writes ``state``, the position and the epoch's metric sums so far."""
        if not self.world.is_chief:
            return
        assert progress.offset is not None  # set by the drivers before training starts
        meta = {
            "epoch": progress.epoch,
            "offset": progress.offset,
            "step_in_epoch": progress.offset // global_batch,
            "global_batch": global_batch,
            "global_step": global_step,
            "world_size": self.world.size,
            "run": record,
            "time": time.time(),
            "last_record": last_record,
        }
        arrays = [np.asarray(v.numpy()) for v in state] + [np.asarray(partial_sums, np.float64)]
        names = [compat.variable_name(v) for v in state] + ["metric_sums"]
        checkpoint_file.save(self.directory, arrays, names, meta, self.config.keep_checkpoints)
