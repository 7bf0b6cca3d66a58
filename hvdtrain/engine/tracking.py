"""Experiment trackers (``--track mlflow wandb tensorboard``): the run logged once per job, by
rank 0, and continued when the run resumes.

What each tracker gets, from the run directory's own records:
- at the start: the run's settings (config.json) as parameters (MLflow) or config (W&B), or
  as hyperparameters (TensorBoard's HParams dashboard);
- at each epoch's end: the epoch's metrics (the exact global ones) at the run's global step;
- at the end: the result's numbers, the phase timings (``time_<phase>``), and ``model.keras``,
  ``config.json``, ``result.json``, ``metrics.jsonl`` and a record of the checkpoints as
  artifacts; the tracker's run is then ended (finished, killed by a preemption, or failed).

``RUN_DIR/tracking.json`` keeps each tracker's run id, so the same command after a SIGTERM (or
a retried cluster job) continues that run; epochs it logged before are not logged again (a
resumed run trains from its checkpoint, and exact resume trains them to the same numbers).

Training never waits on the network: rank 0 hands each event to a thread of its own, which
calls the trackers in order. A tracker that cannot be reached (checked with a short connect
first, so that a server that is down costs seconds, not a client's retries) or that fails is
one warning, and the run trains on without it; with ``--track-required`` it stops the run
instead (every rank, exit 1). At the end rank 0 waits up to ``FLUSH_SECONDS`` for the thread.

The trackers' own variables configure them (``MLFLOW_TRACKING_URI``,
``MLFLOW_EXPERIMENT_NAME``, ``WANDB_MODE``, ``WANDB_PROJECT``, ``WANDB_API_KEY``, ...);
their packages are imported only when a run asks for them (``pip install "hvdtrain[track]"``).
Each service's client (``MLflow``, ``Wandb``, ``TensorBoard``) is in ``tracker_backends``.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import tempfile
import threading
import uuid
from collections.abc import Callable

from hvdtrain.base.errors import StorageError
from hvdtrain.base.files import write_json_atomic
from hvdtrain.engine.rundir import CONFIG, METRICS, RESULT, TRACKING, RunDir
from hvdtrain.engine.tracker_backends import BACKENDS

RECORD = TRACKING  # RUN_DIR/tracking.json
FLUSH_SECONDS = 120.0  # at the end: how long rank 0 waits for the trackers' calls to finish
START_SECONDS = 60.0  # --track-required: how long the start may take before it counts as failed
# An epoch record's keys that are not metrics (they are the step, or say which epoch).
NOT_METRICS = ("epoch", "epochs", "global_step", "world_size")
ARTIFACTS = (CONFIG, METRICS, RESULT)


class TrackerError(StorageError):
    """A tracker failed while ``--track-required`` is set: every rank stops (exit 1)."""


class Trackers:
    """Rank 0's trackers for one run: ``start``, ``epoch``, ``finish``, then ``close``."""

    def __init__(self, names, run_dir: RunDir, required: bool, notice: Callable[[str], None]):
        self.names, self.dir, self.required, self.notice = tuple(names), run_dir, required, notice
        self.live: dict = {}  # name: backend, while it works
        self.failed: str | None = None  # the first failure's line (--track-required)
        self.record: dict = {}
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # --- the training thread's calls --------------------------------------------------------
    def start(self, config: dict, kept: list) -> None:
        """Open (or continue) each tracker's run with the run's settings; send it the
        ``kept`` epochs' records (metrics.jsonl's, a resume's) that it does not have: a
        stopped run's last epochs can be lost on their way when its launcher ends it."""
        self.record = self._read()
        # Each tracker's run gets the job's id first, written before any tracker is called:
        # a process stopped before it saved a tracker's run id leaves the next one a way to
        # find that run (MLflow: a tag; W&B: the run's id).
        for name in self.names:
            self.record.setdefault(name, {}).setdefault("job", uuid.uuid4().hex)
        self._write()
        self._thread = threading.Thread(target=self._work, name="hvdtrain-trackers", daemon=True)
        self._thread.start()
        self._put(self._start, config)
        for record in kept:
            self._put(self._epoch, dict(record))
        if self.required:  # the tracker must be there before training starts
            done = threading.Event()
            self._put(done.set)
            if not done.wait(START_SECONDS):
                self._fail("start", TimeoutError(f"no answer in {START_SECONDS:.0f} s"))
        self.check()

    def epoch(self, record: dict) -> None:
        self.check()
        self._put(self._epoch, dict(record))

    def finish(self, result: dict) -> None:
        self.check()
        self._put(self._finish, dict(result))

    def close(self, status: str, seconds: float | None = None) -> None:
        """End each tracker's run with ``status`` (FINISHED, KILLED, FAILED); wait up to
        ``seconds`` (FLUSH_SECONDS) for the calls still queued."""
        if self._thread is None:
            return
        seconds = FLUSH_SECONDS if seconds is None else seconds
        self._put(self._end, status)
        self._put(None)
        self._thread.join(seconds)
        if self._thread.is_alive() and seconds:
            self.notice(
                f"hvdtrain: warning: the trackers ({', '.join(self.live)}) still had "
                f"not answered after {seconds:.0f} s: left behind, the run is saved in "
                f"{self.dir}"
            )
        self._thread = None

    def check(self) -> None:
        """--track-required: raise the first failure (on rank 0; ``Run.rank0_writes`` makes
        it every rank's)."""
        if self.failed:
            raise TrackerError(self.failed)

    # --- the trackers' thread --------------------------------------------------------------
    def _put(self, fn, *args) -> None:
        self._queue.put(None if fn is None else (fn, args))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            fn(*args)

    def _each(self, what: str, call) -> None:
        for name, tracker in list(self.live.items()):
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 (a tracker's failure is never training's)
                self._fail(what, e, name)

    def _fail(self, what: str, e: BaseException, name: str | None = None) -> None:
        names = [name] if name else list(self.live)
        for n in names:
            self.live.pop(n, None)
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        line = (
            f"tracker {'/'.join(names) or ', '.join(self.names)} failed at the {what}: "
            f"{type(e).__name__}: {reason}"
        )
        if self.required:
            self.failed = self.failed or (
                f"{line}; the run stops (--track-required); the checkpoints are in {self.dir}"
            )
        else:
            self.notice(
                f"hvdtrain: warning: {line}; training goes on without it "
                "(--track-required stops instead)"
            )

    def _start(self, config: dict) -> None:
        run_name = os.path.basename(self.dir.path)
        for name in self.names:
            try:
                tracker = BACKENDS[name]()
                saved = self.record[name]
                info = tracker.start(saved, saved.get("run_name", run_name), config, self.dir.path)
            except Exception as e:  # noqa: BLE001
                self.live[name] = None
                self._fail("start", e, name)
                continue
            self.live[name] = tracker
            self.record[name] = {
                **saved,
                **info,
                "epochs_logged": max(saved.get("epochs_logged", 0), info.get("epochs_logged", 0)),
            }
            self._write()  # at once: the run's id, for the next run of this job

    def _epoch(self, record: dict) -> None:
        values = {
            k: v
            for k, v in record.items()
            if k not in NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        values["epoch"] = record["epoch"]
        for name, tracker in list(self.live.items()):
            if record["epoch"] <= self.record[name].get("epochs_logged", 0):
                continue  # logged before the run was stopped; trained to the same numbers
            try:
                tracker.metrics(values, record["global_step"])
            except Exception as e:  # noqa: BLE001
                self._fail(f"epoch {record['epoch']}", e, name)
                continue
            self.record[name]["epochs_logged"] = record["epoch"]
        self._write()

    def _finish(self, result: dict) -> None:
        numbers = {
            k: v
            for k, v in result.items()
            if isinstance(v, (int, float))
            and not isinstance(v, bool)
            and k not in ("world_size", "epochs")
        }
        numbers.update(
            {
                f"time_{k}": v
                for k, v in (result.get("timings") or {}).items()
                if isinstance(v, (int, float))
            }
        )
        paths = [
            os.path.join(self.dir.path, f)
            for f in ARTIFACTS
            if os.path.exists(os.path.join(self.dir.path, f))
        ]
        model = result.get("model")
        if model and os.path.exists(model):
            paths.append(model)
        with tempfile.TemporaryDirectory(prefix="hvdtrain-track-") as tmp:
            listing = os.path.join(tmp, "checkpoints.json")
            with open(listing, "w") as f:
                json.dump(_checkpoints(self.dir.checkpoints), f, indent=1)
            paths.append(listing)
            step = int(result.get("global_step", 0))
            self._each(
                "end",
                lambda t: t.summary(numbers) if hasattr(t, "summary") else t.metrics(numbers, step),
            )
            self._each("end", lambda t: t.artifacts(paths))

    def _end(self, status: str) -> None:
        self._each("close", lambda t: t.end(status))
        self._write()

    # --- RUN_DIR/tracking.json --------------------------------------------------------------
    def _read(self) -> dict:
        try:
            with open(self.dir.tracking) as f:
                saved = json.load(f)
            return saved if isinstance(saved, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write(self) -> None:
        try:
            write_json_atomic(self.dir.tracking, self.record)
        except Exception as e:  # noqa: BLE001 (the run directory's own writes will say it)
            self.notice(f"hvdtrain: warning: cannot write {RECORD}: {e}")


def _checkpoints(directory: str) -> list:
    """The checkpoints on disk: name, bytes and modification time (not their contents)."""
    paths = sorted(glob.glob(os.path.join(glob.escape(directory), "ckpt-*")))
    return [
        {"file": os.path.basename(p), "bytes": os.path.getsize(p), "mtime": os.path.getmtime(p)}
        for p in paths
        if not p.endswith(".tmp")
    ]
