"""Checkpoints of a run: find and check the newest, restore it, save, commit (elastic).

A mixin of the training run (``train._Run``): it needs the run's ``world``, ``config``,
``task``, ``out``, ``ckpt_dir``, ``variables`` (model, optimizer, then the epoch's metric
sums), ``optimizer``, ``batch`` and ``last_record``. Only rank 0 reads and writes files;
the partial sums it saves are the exact sums over every rank.
"""
from __future__ import annotations

import time

import numpy as np

from hvdtrain import checkpoint, compat


class Checkpointing:
    def _find_checkpoint(self):
        """Rank 0: the newest valid checkpoint's (meta, arrays, path), or None to start fresh."""
        if not self.world.is_chief:
            return None
        found = checkpoint.list_checkpoints(self.ckpt_dir)
        if self.config.resume is False and found:
            raise checkpoint.CheckpointError(
                f"{self.ckpt_dir} holds {len(found)} checkpoint(s) and --no-resume was given: "
                "choose a new --run-dir, or drop --no-resume to continue")
        state = checkpoint.load_latest(self.ckpt_dir, self.out.notice) if found else None
        if state is None and self.config.resume:
            raise checkpoint.CheckpointError(f"--resume: no checkpoint in {self.ckpt_dir}")
        if state is not None:
            saved, now = dict(state[0]["run"]), self._run_dict(defines_run=True)
            saved.update(saved.pop("settings", {}))  # the task's settings, flattened
            now.update(now.pop("settings"))
            changed = [f"--{k.replace('_', '-')} {saved.get(k)} -> {v}" if k != "task" else
                       f"task {saved.get(k)} -> {v}" for k, v in now.items()
                       if k in saved and saved[k] != v]
            if changed:
                raise checkpoint.CheckpointError(
                    f"{state[2]} was made with other settings ({'; '.join(changed)}): resume "
                    "with the same settings, or choose a new --run-dir")
        return state

    def _restore(self, found) -> dict:
        """Rank 0: load a found checkpoint into the variables; return the progress fields."""
        if found is None:
            return {"epoch": 0, "offset": 0, "sums": None, "last_record": None, "path": None}
        meta, arrays, path = found
        if len(arrays) != len(self.variables) or any(
                list(a.shape) != list(v.shape) for a, v in zip(arrays, self.variables)):
            raise checkpoint.CheckpointError(f"{path}: its variables do not match this model")
        for variable, value in zip(self.variables[:-1], arrays):
            variable.assign(value)
        return {"epoch": meta["epoch"], "offset": meta["offset"], "sums": arrays[-1].tolist(),
                "last_record": meta.get("last_record"), "path": path}

    def _partial_sums(self) -> list:
        """All ranks: the epoch's sums so far over every rank (what rank 0 keeps on resume)."""
        return self.world.allreduce_sum(self.sums.numpy()).tolist()

    def _save(self, progress) -> None:
        """All ranks: combine the partial sums; rank 0 writes the checkpoint."""
        partial = self._partial_sums()
        # Every rank holds the same weights, so every rank takes the same decision here: a
        # checkpoint of NaN weights would make the "last good" one useless.
        if self.config.stop_on_divergence and not all(
                np.isfinite(v.numpy()).all() for v in self.model.trainable_variables):
            raise self._diverged(f"the weights became NaN or infinite by step "
                                 f"{int(self.optimizer.iterations.numpy())}")
        if not self.world.is_chief:
            return
        global_batch = self.batch * self.world.size
        meta = {"epoch": progress.epoch, "offset": progress.offset,
                "step_in_epoch": progress.offset // global_batch, "global_batch": global_batch,
                "global_step": int(self.optimizer.iterations.numpy()),
                "world_size": self.world.size, "run": self._run_dict(), "time": time.time(),
                "last_record": self.last_record}
        arrays = [v.numpy() for v in self.variables[:-1]] + [np.asarray(partial)]
        checkpoint.save(self.ckpt_dir, arrays, [compat.variable_name(v) for v in self.variables], meta,
                        self.config.keep_checkpoints)

    def _commit(self, progress) -> None:
        """Elastic: remember this step in memory; may raise Horovod's hosts-updated interrupt."""
        progress.sums, progress.last_record = self._partial_sums(), self.last_record
        progress.commit()
