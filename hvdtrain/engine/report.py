"""What a run leaves behind: console lines and the run directory, written by rank 0 only.

Run directory layout (``rundir.RunDir`` names each path):
    config.json      the task, the validated training settings and the task's own, plus
                     world size, backend, Keras and the learning rate applied
    metrics.jsonl    one JSON line per epoch: epoch, global_step, loss, metrics, samples_per_sec
    tensorboard/     the same scalars for TensorBoard
    model.keras      the trained model (Keras format), unless --no-save-model
    result.json      written last (atomically): the run's outcome
    tracking.json    with --track: each experiment tracker's run id (a resume continues it)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from hvdtrain.base.config import env_number
from hvdtrain.base.errors import StorageError
from hvdtrain.base.files import (
    atomic_open,
    finite_json,
    make_dirs,
    remove_leftovers,
    replacing,
    write_json_atomic,
    writing,
)
from hvdtrain.engine.rundir import RunDir, RunLock

if TYPE_CHECKING:
    from hvdtrain.engine.tracking import Trackers

# Where no live progress bar is drawn (a launcher's pipe, a SLURM or Kubernetes log), rank 0
# prints a plain line this often inside an epoch (HVDTRAIN_PROGRESS_SECONDS; 0: never).
PROGRESS_SECONDS = 30.0


@dataclasses.dataclass
class EpochRecord:
    """One finished epoch: a line of metrics.jsonl (``as_dict``), the same on both paths.

    Attributes:
        epoch: its number, from 1.
        epochs: the epochs the run is set to train.
        global_step: the updates made by its end.
        metrics: its mean loss and metrics over every rank's examples (``loss``,
            ``accuracy``, the fit path's ``val_*``), by name.
        samples_per_sec: the examples this process trained in it (fewer after a resume),
            over all ranks, per second.
        seconds: its time.
        world_size: the ranks that trained it.
        input_wait: a tf.data input's share of its time the slowest rank's steps waited.
    """

    epoch: int
    epochs: int
    global_step: int
    metrics: dict
    samples_per_sec: float
    seconds: float
    world_size: int
    input_wait: float | None = None

    def as_dict(self) -> dict:
        """The record as metrics.jsonl and the checkpoints keep it: the metrics by name
        beside the other fields (``input_wait`` only with a tf.data input)."""
        out = {
            "epoch": self.epoch,
            "epochs": self.epochs,
            "global_step": self.global_step,
            **self.metrics,
            "samples_per_sec": self.samples_per_sec,
            "seconds": self.seconds,
            "world_size": self.world_size,
        }
        if self.input_wait is not None:
            out["input_wait"] = self.input_wait
        return out

    @classmethod
    def from_dict(cls, record: dict) -> EpochRecord:
        """A record as ``as_dict`` made it (a checkpoint's, a line of metrics.jsonl)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"metrics"}
        given: dict[str, Any] = {k: record.get(k) for k in fields}  # as the record has them
        return cls(metrics={k: v for k, v in record.items() if k not in fields}, **given)


def _scalars(values: dict) -> bytes:
    """A serialized ``tf.Summary`` of scalars, each as ``tf.summary.scalar`` writes one: a
    float32 tensor tagged for TensorBoard's scalars plugin."""
    from tensorflow.core.framework import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

    plugin = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    return summary_pb2.Summary(
        value=[
            summary_pb2.Summary.Value(
                tag=tag,
                metadata=plugin,
                tensor=tensor_pb2.TensorProto(
                    dtype=types_pb2.DT_FLOAT,
                    tensor_shape=tensor_shape_pb2.TensorShapeProto(),
                    float_val=[value],
                ),
            )
            for tag, value in values.items()
        ]
    ).SerializeToString()


class Reporter:
    """Prints and writes on the chief; does nothing on other ranks."""

    def __init__(
        self, world, run_dir: RunDir, verbose: int = 1, track=(), track_required: bool = False
    ):
        self.world, self._verbose, self.dir = world, verbose, run_dir
        self._track, self._track_required = tuple(track), track_required
        self.trackers: Trackers | None = None  # on rank 0 once the run starts
        self._config: dict | None = None  # config.json's dict, once the run starts
        self._tb: Any | None = None  # rank 0's tf.summary file writer (start)
        self._lock: RunLock | None = None
        self._progress_every = env_number(
            "HVDTRAIN_PROGRESS_SECONDS",
            PROGRESS_SECONDS,
            lambda v: v >= 0,
            "must be a number of seconds, 0 or more (0: no progress lines)",
        )
        self._epoch_began = self._progress_at = time.monotonic()

    def problem(self):
        """Rank 0: why the run directory cannot be used (None if it can); creates nothing."""
        return self.dir.problem() if self.enabled else None

    def finished(self, epochs: int, defining: dict):
        """Rank 0: the result.json of a finished run in the run directory that trained at
        least ``epochs`` epochs (early stopping included) with the settings ``defining``
        (``Run.record(defines_run=True)``; config.json has them), else None: the same command
        again must not train it again and overwrite its result; more epochs train on, and
        other settings are refused by the checkpoints' comparison."""
        if not self.enabled:
            return None
        try:
            with open(self.dir.result) as f:
                done = json.load(f)
            with open(self.dir.config) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return None  # none, or unreadable: the checkpoints decide, as before
        same = all(saved.get(k) == v for k, v in defining.items() if k != "settings") and all(
            saved.get("settings", {}).get(k) == v for k, v in defining["settings"].items()
        )
        return done if same and done.get("epochs", 0) >= epochs else None

    def claim(self) -> None:
        """Rank 0: create the run directory and hold it for this run (RunDirBusy if taken);
        remove the temporary files of writes that a killed or failed run left."""
        if self.enabled and self._lock is None:
            self._lock = self.dir.lock()
            from hvdtrain.engine import checkpoint_file

            remove_leftovers(self.dir.path)
            checkpoint_file.remove_leftovers(self.dir.checkpoints)

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
        from hvdtrain.base.launch import launcher_size

        return sys.stdout.isatty() and launcher_size() == 1

    def epoch_began(self) -> None:
        """An epoch's steps start now (the periodic progress lines count from here)."""
        self._epoch_began = self._progress_at = time.monotonic()

    def progress_due(self, drawn: bool = False) -> bool:
        """Rank 0 at verbose 1 with no live bar (``drawn``): is a progress line due?"""
        if self.verbose != 1 or drawn or not self._progress_every:
            return False
        now = time.monotonic()
        if now - self._progress_at < self._progress_every:
            return False
        self._progress_at = now
        return True

    def progress(
        self,
        epoch: int,
        epochs: int,
        step: int,
        steps: int,
        done: int,
        step_examples: int,
        metrics: dict,
    ) -> None:
        """One plain progress line: the epoch's step, rank 0's running metrics, the rate of
        the ``done`` steps (of ``step_examples`` over all ranks each) since the epoch began,
        and the epoch's time left."""
        seconds = max(time.monotonic() - self._epoch_began, 1e-9)
        rate = done / seconds
        left = (steps - step) / rate if rate else float("nan")
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self.print(
            f"Epoch {epoch}/{epochs}  step {step}/{steps}  {shown}  "
            f"{rate * step_examples:,.0f} samples/s  epoch ETA {_duration(left)}"
        )

    def print(self, message: str, level: int = 1) -> None:
        if self.verbose >= level:
            _whole_line(sys.stdout, message)

    def notice(self, message: str) -> None:
        """A one-line notice on stderr (rank 0), shown even at verbose 0."""
        if self.enabled:
            _whole_line(sys.stderr, message)

    def start(self, config_dict: dict, completed_epochs: int = 0) -> None:
        """Create the run directory; keep only the metrics of epochs a resume starts after."""
        self._config = config_dict  # every rank: an elastic run's next rank 0 tracks from it
        if not self.enabled:
            return
        with writing(self.dir.path):
            make_dirs(self.dir.path)
        write_json_atomic(self.dir.config, config_dict)
        metrics = self.dir.metrics
        if os.path.exists(metrics):
            # Epochs after the checkpoint will be trained (and logged) again; a line cut short
            # (its write killed, or the disk full) is an epoch after it.
            with open(metrics) as f:
                kept = [l for l in f if _epoch(l) is not None and _epoch(l) <= completed_epochs]
            with atomic_open(metrics) as f:
                f.writelines(kept)
        import tensorflow as tf

        if self._tb is None:
            board = self.dir.tensorboard
            with writing(board, also=(tf.errors.OpError,)):
                self._tb = tf.summary.create_file_writer(board)
        self._start_trackers()

    def _start_trackers(self) -> None:
        """Rank 0: the trackers (``--track``), with the run's settings; the kept epochs too,
        so that those a stopped run could not send are sent now."""
        if self._track and self.trackers is None:
            from hvdtrain.engine.tracking import Trackers

            assert self._config is not None  # start() kept it before any call here
            self.trackers = Trackers(self._track, self.dir, self._track_required, self.notice)
            self.trackers.start(self._config, self.records())

    def records(self) -> list:
        """Rank 0: metrics.jsonl's records, in order ([] if none)."""
        path = self.dir.metrics
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def epoch(self, record: dict) -> None:
        if not self.enabled:
            return
        path = self.dir.metrics
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

        assert self._tb is not None  # start() made it on this rank (rank 0)
        with writing(self.dir.tensorboard, also=(tf.errors.OpError,)):
            with self._tb.as_default(step=record["global_step"]):
                # The epoch's scalars in one Summary, written by one op (what
                # tf.summary.scalar writes, value by value, at one op each).
                tf.summary.experimental.write_raw_pb(
                    _scalars(
                        {
                            k: v
                            for k, v in record.items()
                            if k not in ("epoch", "epochs", "global_step") and isinstance(v, float)
                        }
                    )
                )
            self._tb.flush()
        if self.trackers is None and self._config is not None:
            self._start_trackers()  # an elastic run whose rank 0 changed: it tracks now
        if self.trackers is not None:
            self.trackers.epoch(record)

    def save_model(self, model):
        """Rank 0: the trained model as RUN_DIR/model.keras (keras.models.load_model opens it,
        without hvdtrain); returns the path (None on other ranks)."""
        if not self.enabled:
            return None
        path = self.dir.model
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
            weights = self.dir.model_weights
            with replacing(weights, suffix=".weights.h5") as tmp:  # Keras' required suffix
                model.save_weights(tmp)
            self.notice(
                f"hvdtrain: warning: model.keras not saved: Keras cannot save this "
                f"{type(model).__name__} whole ({type(e).__name__}: {why}); its weights are in "
                f"{weights} (model.load_weights opens them in the model built in code)"
            )
            return weights

    def result(self, result: dict) -> None:
        if not self.enabled:
            return
        if self._tb is not None:
            import tensorflow as tf

            with writing(self.dir.tensorboard, also=(tf.errors.OpError,)):
                self._tb.close()
        write_json_atomic(self.dir.result, result)
        if self.trackers is not None:
            self.trackers.finish(result)

    def close_trackers(self, e) -> None:
        """Rank 0, as the run ends (``e``: its exception, or None): each tracker's run ended
        as finished, killed (a preemption) or failed, its queued calls waited for."""
        if self.trackers is not None:
            from hvdtrain.base.errors import Preempted

            # A stopped or failed run waits briefly (the other ranks wait for rank 0's last line;
            # what is not sent by then, a resumed run sends).
            status = "FINISHED" if e is None else "KILLED" if isinstance(e, Preempted) else "FAILED"
            self.trackers.close(status, seconds=None if e is None else 10.0)
            self.trackers = None


def _epoch(line: str):
    """A metrics.jsonl line's epoch; None for a blank line or one cut short."""
    try:
        return json.loads(line)["epoch"]
    except (ValueError, KeyError, TypeError):
        return None


def _duration(seconds: float) -> str:
    if seconds != seconds:  # NaN: no step done yet
        return "?"
    seconds = int(round(seconds))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _whole_line(stream, message: str) -> None:
    """``message`` and its newline in one write: ``print`` writes them apart, and a launcher
    that tags its ranks' output (mpirun's ``[1,0]<stdout>:``) then tags the newline alone."""
    stream.write(message + "\n")
    stream.flush()
