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

import fcntl
import json
import math
import os
import socket
import sys
import time

from hvdtrain.base.errors import EnvError, RunDirBusy, RunDirHeld, StorageError
from hvdtrain.base.files import atomic_open, make_dirs, remove_leftovers, replacing, writing

# What a run directory holds as folders: a file named like one would make every save fail.
FOLDERS = ("checkpoints", "tensorboard")


def default_run_dir(task: str, root: str = "runs") -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(root, f"{task}-{stamp}"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{task}-{stamp}-{n}")
    return path


def _scalars(values: dict) -> bytes:
    """A serialized ``tf.Summary`` of scalars, each as ``tf.summary.scalar`` writes one: a
    float32 tensor tagged for TensorBoard's scalars plugin."""
    from tensorflow.core.framework import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

    plugin = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(
        tag=tag, metadata=plugin, tensor=tensor_pb2.TensorProto(
            dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(),
            float_val=[value])) for tag, value in values.items()]).SerializeToString()


def weights_agreement(world, model) -> dict:
    """Every rank must end with the same weights (synchronous updates): compare digests.

    Returns ``weights_sha256`` (rank 0's), ``ranks_identical`` for result.json, and
    ``differ``, the ranks whose weights or layers' state are not rank 0's (empty when
    identical). One host allreduce on every rank (``World.all_same``); the allgather that
    names the ranks only when they differ.
    """
    import hashlib

    import numpy as np

    from hvdtrain.base.compat import variables
    from hvdtrain.engine.preflight import layer_state

    digest = hashlib.sha256()
    for v in variables(model.weights):
        digest.update(np.ascontiguousarray(v.numpy()).tobytes())
    # The state outside the weights (vocabularies, Normalization's tensors) is compared too:
    # ranks with other vocabularies are other models even with the same weights.
    state = layer_state(model)
    mine = (digest.hexdigest(), state)
    if world.all_same(mine):
        return {"weights_sha256": mine[0], "ranks_identical": True, "differ": []}
    digests = world.allgather_object(mine)
    differ = [r for r, (d, s) in enumerate(digests)
              if d != digests[0][0] or s != digests[0][1]]
    return {"weights_sha256": digests[0][0], "ranks_identical": not differ, "differ": differ}


def ranks_differ_line(differ, step: int, fit: bool) -> str:
    """Why the ranks' models can differ after synchronous updates, and what to do."""
    where = ("the model's own train_step, a callback" if fit else "the task's code")
    return (f"the model of rank(s) {differ} differs from rank 0's at step {step} (weights or "
            f"layers' state): something changed it outside the distributed optimizer on "
            f"each rank alone ({where}: a variable's assign/assign_add/assign_sub, or an "
            f"optimizer that is not hk.DistributedOptimizer); every update must go through "
            f"the distributed optimizer, or be the same on every rank")


def run_dir_problem(path: str):
    """Why ``path`` cannot hold a new or continued run (None when it can). Creates nothing.

    A file where the directory should be, a file above it, no permission to write, or a
    finished run (result.json) with no checkpoint to continue from: each would fail late,
    with a traceback, or silently overwrite a finished run.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"is under {existing}, which is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be written ({existing}: permission denied or read-only file system)"
    for name in FOLDERS:
        inside = os.path.join(path, name)
        if os.path.exists(inside) and not os.path.isdir(inside):
            return (f"holds a file {name} where its {name}/ folder belongs: move it away "
                    f"(and put the {name} back, to resume)")
    checkpoints = os.path.join(path, "checkpoints")
    if os.path.exists(os.path.join(path, "result.json")) and not (
            os.path.isdir(checkpoints) and any(n.endswith(".hvdt") for n in os.listdir(checkpoints))):
        return ("holds a finished run (result.json) and no checkpoint to continue from: "
                "choose a new one rather than overwrite it")
    return None


LOCK_WAIT = 120.0  # HVDTRAIN_LOCK_WAIT's default: NFSv4's 90 s lease, and a margin


def lock_wait() -> float:
    """HVDTRAIN_LOCK_WAIT: seconds to wait for a run directory held by a run elsewhere."""
    raw = os.environ.get("HVDTRAIN_LOCK_WAIT", "")
    try:
        value = float(raw) if raw else LOCK_WAIT
    except ValueError:
        value = -1.0
    if not 0 <= value <= 86400:
        raise EnvError(f"HVDTRAIN_LOCK_WAIT={raw}: give seconds from 0 to 86400 (default "
                       f"{LOCK_WAIT:g})")
    return value


def _identity(pid: int) -> str:
    """What tells a live process apart from a later one with the same pid and host name (a
    re-created pod): this boot of the machine and the process's start time."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
    return f"boot {boot} start {start}"


class RunLock:
    """Rank 0's exclusive hold on a run directory for the whole run.

    ``flock`` on RUN_DIR/.lock: on a local file system the kernel drops it when the holder
    exits, however it exits (SIGKILL included), so a lock left by a killed run never blocks
    the next one; the file keeps the holder's pid, host and start time for the message a
    second run gets, and (line 2) what identifies that process. On a network file system a
    crashed node's lock stays with the server until the node's lease expires (NFSv4: 90 s):
    a holder that is not a live process of this host is therefore waited for, up to
    ``HVDTRAIN_LOCK_WAIT`` seconds (``RunDirHeld``, exit 73, after that); a live one here is
    refused at once (``RunDirBusy``: two runs on one directory, the user's to fix).
    """

    def __init__(self, run_dir: str, wait: float = None):
        path = os.path.join(run_dir, ".lock")
        with writing(path):
            make_dirs(run_dir)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if not self._take():
            holder, identity = self._holder()
            wait = lock_wait() if wait is None else wait
            if self._live_here(holder, identity) or not self._wait(run_dir, holder, wait):
                os.close(self._fd)
                if self._live_here(holder, identity):
                    raise RunDirBusy(f"{run_dir} is in use by another run ({holder}): wait "
                                     "for it to end, or choose another --run-dir") from None
                raise RunDirHeld(f"{run_dir} is still locked after {wait:g} s by a run "
                                 f"elsewhere ({holder}): a run on another node, or a crashed "
                                 "node's lock the file server keeps; retry later (exit 73), "
                                 "or choose another --run-dir") from None
        with writing(path):
            self._write(f"pid {os.getpid()} on {socket.gethostname()} since "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n{_identity(os.getpid())}\n")

    def _take(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _holder(self):
        lines = os.pread(self._fd, 1024, 0).decode(errors="replace").splitlines() + ["", ""]
        return lines[0].strip() or "unknown", lines[1].strip()

    @staticmethod
    def _live_here(holder: str, identity: str) -> bool:
        """The holder is a process of this host that still lives (the same one: same boot,
        same start time), not a dead node's or another pod's."""
        words = holder.split()
        if len(words) < 4 or words[0] != "pid" or words[2] != "on" or not words[1].isdigit():
            return False
        return words[3] == socket.gethostname() and bool(identity) and \
            _identity(int(words[1])) == identity

    def _wait(self, run_dir: str, holder: str, wait: float) -> bool:
        if wait <= 0:
            return False
        sys.stderr.write(f"hvdtrain: {run_dir} is locked by a run elsewhere ({holder}): "
                         f"waiting up to {wait:g} s (HVDTRAIN_LOCK_WAIT) for its lock to "
                         "end\n")
        sys.stderr.flush()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            if self._take():
                return True
        return False

    def _write(self, text: str) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def finite_json(obj):
    """``obj`` with NaN and infinities as null: result.json and metrics stay valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_json_atomic(path: str, obj) -> None:
    """Readers see the old file or the whole new one, never half of it."""
    with atomic_open(path) as f:
        json.dump(finite_json(obj), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")


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
        self._lock = None

    def problem(self):
        """Rank 0: why the run directory cannot be used (None if it can); creates nothing."""
        return run_dir_problem(self.run_dir) if self.enabled else None

    def finished(self, epochs: int, defining: dict):
        """Rank 0: the result.json of a finished run in the run directory that trained at
        least ``epochs`` epochs (early stopping included) with the settings ``defining``
        (``Run.record(defines_run=True)``; config.json has them), else None: the same command
        again must not train it again and overwrite its result; more epochs train on, and
        other settings are refused by the checkpoints' comparison."""
        if not self.enabled:
            return None
        try:
            with open(os.path.join(self.run_dir, "result.json")) as f:
                done = json.load(f)
            with open(os.path.join(self.run_dir, "config.json")) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return None  # none, or unreadable: the checkpoints decide, as before
        same = all(saved.get(k) == v for k, v in defining.items() if k != "settings") and all(
            saved.get("settings", {}).get(k) == v for k, v in defining["settings"].items())
        return done if same and done.get("epochs", 0) >= epochs else None

    def claim(self) -> None:
        """Rank 0: create the run directory and hold it for this run (RunDirBusy if taken);
        remove the temporary files of writes that a killed or failed run left."""
        if self.enabled and self._lock is None:
            self._lock = RunLock(self.run_dir)
            from hvdtrain.engine import checkpoint

            remove_leftovers(self.run_dir)
            checkpoint.remove_leftovers(os.path.join(self.run_dir, "checkpoints"))

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def enabled(self) -> bool:
        return self.world.is_chief  # asked each time: an elastic reset can change rank 0

    @property
    def verbose(self) -> int:
        return self._verbose if self.enabled else 0

    @property
    def interactive(self) -> bool:
        """A live progress bar is worth drawing: a terminal, and no launcher. (mpirun gives
        its ranks a pseudo-terminal even when its own output is a pipe, and tags and
        interleaves their lines, so a bar's carriage returns end up in the log.)"""
        from hvdtrain.distributed.launch import launcher_size
        return sys.stdout.isatty() and launcher_size() == 1

    def print(self, message: str, level: int = 1) -> None:
        if self.verbose >= level:
            _whole_line(sys.stdout, message)

    def notice(self, message: str) -> None:
        """A one-line notice on stderr (rank 0), shown even at verbose 0."""
        if self.enabled:
            _whole_line(sys.stderr, message)

    def start(self, config_dict: dict, completed_epochs: int = 0) -> None:
        """Create the run directory; keep only the metrics of epochs a resume starts after."""
        if not self.enabled:
            return
        with writing(self.run_dir):
            make_dirs(self.run_dir)
        write_json_atomic(os.path.join(self.run_dir, "config.json"), config_dict)
        metrics = os.path.join(self.run_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            # Epochs after the checkpoint will be trained (and logged) again; a line cut short
            # (its write killed, or the disk full) is an epoch after it.
            with open(metrics) as f:
                kept = [l for l in f if _epoch(l) is not None and _epoch(l) <= completed_epochs]
            with atomic_open(metrics) as f:
                f.writelines(kept)
        import tensorflow as tf

        if self._tb is None:
            board = os.path.join(self.run_dir, "tensorboard")
            with writing(board, also=(tf.errors.OpError,)):
                self._tb = tf.summary.create_file_writer(board)

    def records(self) -> list:
        """Rank 0: metrics.jsonl's records, in order ([] if none)."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def epoch(self, record: dict) -> None:
        if not self.enabled:
            return
        path = os.path.join(self.run_dir, "metrics.jsonl")
        line = json.dumps(finite_json(record), sort_keys=True, allow_nan=False) + "\n"
        with writing(path), open(path, "a") as f:
            size = f.tell()
            try:
                f.write(line)
                f.flush()
            except OSError:
                f.truncate(size)  # no half line (the disk full): the file as it was
                raise
        import tensorflow as tf

        with writing(os.path.join(self.run_dir, "tensorboard"), also=(tf.errors.OpError,)):
            with self._tb.as_default(step=record["global_step"]):
                # The epoch's scalars in one Summary, written by one op (what
                # tf.summary.scalar writes, value by value, at one op each).
                tf.summary.experimental.write_raw_pb(_scalars(
                    {k: v for k, v in record.items()
                     if k not in ("epoch", "epochs", "global_step") and isinstance(v, float)}))
            self._tb.flush()

    def save_model(self, model):
        """Rank 0: the trained model as RUN_DIR/model.keras (keras.models.load_model opens it,
        without hvdtrain); returns the path (None on other ranks)."""
        if not self.enabled:
            return None
        path = os.path.join(self.run_dir, "model.keras")
        try:
            with replacing(path, suffix=".keras") as tmp:  # Keras saves only to *.keras
                model.save(tmp)
            return path
        except StorageError:
            raise  # the disk, not the model: one line naming model.keras
        except Exception as e:  # noqa: BLE001 (a model Keras cannot save whole)
            # A subclassed model without get_config, say: the training must not be lost
            # with it. Its weights alone load into the same model built in code.
            # Keras' reason, its first sentence, on one line (it breaks it over lines).
            why = " ".join(str(e).split()).split(". ")[0] or "no reason given"
            weights = os.path.join(self.run_dir, "model.weights.h5")
            with replacing(weights, suffix=".weights.h5") as tmp:  # Keras' required suffix
                model.save_weights(tmp)
            self.notice(f"hvdtrain: warning: model.keras not saved: Keras cannot save this "
                        f"{type(model).__name__} whole ({type(e).__name__}: {why}); its weights are in "
                        f"{weights} (model.load_weights opens them in the model built in code)")
            return weights

    def result(self, result: dict) -> None:
        if not self.enabled:
            return
        if self._tb is not None:
            import tensorflow as tf

            with writing(os.path.join(self.run_dir, "tensorboard"), also=(tf.errors.OpError,)):
                self._tb.close()
        write_json_atomic(os.path.join(self.run_dir, "result.json"), result)


def _epoch(line: str):
    """A metrics.jsonl line's epoch; None for a blank line or one cut short."""
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return None


def _whole_line(stream, message: str) -> None:
    """``message`` and its newline in one write: ``print`` writes them apart, and a launcher
    that tags its ranks' output (mpirun's ``[1,0]<stdout>:``) then tags the newline alone."""
    stream.write(message + "\n")
    stream.flush()
