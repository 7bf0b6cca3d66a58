"""What a run leaves behind: console lines and the run directory, written by rank 0 only.

Run directory layout:
    config.json      the task, the validated training settings and the task's own, plus
                     world size, backend and Keras
    metrics.jsonl    one JSON line per epoch: epoch, global_step, loss, metrics, samples_per_sec
    tensorboard/     the same scalars for TensorBoard
    model.keras      the trained model (Keras format), unless --no-save-model
    result.json      written last (atomically): the run's outcome
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def default_run_dir(task: str, root: str = "runs") -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(root, f"{task}-{stamp}"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{task}-{stamp}-{n}")
    return path


def weights_agreement(world, model) -> dict:
    """Every rank must end with the same weights (synchronous updates): compare digests.

    Returns ``weights_sha256`` (rank 0's) and ``ranks_identical`` for result.json; a
    difference would mean the ranks trained different models, and rank 0's file would
    silently speak for one of them, so it is also said on stderr.
    """
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for v in model.weights:
        digest.update(np.ascontiguousarray(v.numpy()).tobytes())
    digests = world.allgather_object(digest.hexdigest())
    agree = len(set(digests)) == 1
    if not agree and world.is_chief:
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        print(f"hvdtrain: warning: the weights of rank(s) {differ} differ from rank 0's after "
              "training; result.json holds rank 0's", file=sys.stderr, flush=True)
    return {"weights_sha256": digests[0], "ranks_identical": agree}


def write_json_atomic(path: str, obj) -> None:
    """Readers see the old file or the whole new one, never half of it."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix="." + os.path.basename(path))
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class Reporter:
    """Prints and writes on the chief; does nothing on other ranks."""

    def __init__(self, world, run_dir, task_name: str, verbose: int = 1):
        self.world, self._verbose = world, verbose
        if run_dir:
            self.run_dir = os.path.abspath(run_dir)
        else:  # rank 0 names the directory (its clock decides) and tells the others
            path = default_run_dir(task_name) if world.is_chief else None
            self.run_dir = os.path.abspath(world.broadcast_object(path))
        self._tb = None

    @property
    def enabled(self) -> bool:
        return self.world.is_chief  # asked each time: an elastic reset can change rank 0

    @property
    def verbose(self) -> int:
        return self._verbose if self.enabled else 0

    @property
    def interactive(self) -> bool:
        """Standard output is a terminal (a live progress bar is worth drawing)."""
        return sys.stdout.isatty()

    def print(self, message: str, level: int = 1) -> None:
        if self.verbose >= level:
            print(message, flush=True)

    def notice(self, message: str) -> None:
        """A one-line notice on stderr (rank 0), shown even at verbose 0."""
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    def start(self, config_dict: dict, completed_epochs: int = 0) -> None:
        """Create the run directory; keep only the metrics of epochs a resume starts after."""
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        write_json_atomic(os.path.join(self.run_dir, "config.json"), config_dict)
        metrics = os.path.join(self.run_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            # Epochs after the checkpoint will be trained (and logged) again.
            with open(metrics) as f:
                kept = [l for l in f if l.strip() and json.loads(l)["epoch"] <= completed_epochs]
            with open(metrics, "w") as f:
                f.writelines(kept)
        import tensorflow as tf

        if self._tb is None:
            self._tb = tf.summary.create_file_writer(os.path.join(self.run_dir, "tensorboard"))

    def epoch(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        import tensorflow as tf

        with self._tb.as_default(step=record["global_step"]):
            for key, value in record.items():
                if key not in ("epoch", "epochs", "global_step") and isinstance(value, float):
                    tf.summary.scalar(key, value)
        self._tb.flush()

    def save_model(self, model):
        """Rank 0: the trained model as RUN_DIR/model.keras (keras.models.load_model opens it,
        without hvdtrain); returns the path (None on other ranks)."""
        if not self.enabled:
            return None
        path = os.path.join(self.run_dir, "model.keras")
        tmp = os.path.join(self.run_dir, ".model.keras.tmp.keras")  # Keras wants the suffix
        model.save(tmp)
        os.replace(tmp, path)
        return path

    def result(self, result: dict) -> None:
        if not self.enabled:
            return
        write_json_atomic(os.path.join(self.run_dir, "result.json"), result)
        if self._tb is not None:
            self._tb.close()
