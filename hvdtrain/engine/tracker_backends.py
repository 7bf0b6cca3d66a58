"""The experiment trackers' clients: one class per service (MLflow, W&B, TensorBoard).

Each meets ``tracking.Trackers`` with the same calls: ``start(saved, run_name, settings,
run_dir)`` (returns what ``RUN_DIR/tracking.json`` keeps to continue the tracker's run),
``metrics(values, step)``, ``artifacts(paths)`` and ``end(status)`` (W&B also ``summary``).
A service is first checked with a short connect (``reachable``), so that a server that is
down costs seconds, not a client's retries. Their packages are imported only when a run
asks for them (``pip install "hvdtrain[track]"``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from urllib.parse import urlparse

from hvdtrain.engine.rundir import TENSORBOARD

CONNECT_SECONDS = 10.0  # the reachability check of a tracker's server


def flat(settings: dict, prefix: str = "") -> dict:
    """config.json's nested dict as one level: ``settings.hidden_units`` and so on; lists as
    their JSON text."""
    out = {}
    for key, value in settings.items():
        name = prefix + key
        if isinstance(value, dict):
            out.update(flat(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple)) else value
    return out


def reachable(url: str) -> str | None:
    """Why ``url``'s host and port cannot be connected to within CONNECT_SECONDS (None if
    they can, or the URL is not a network one)."""
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=CONNECT_SECONDS).close()
    except OSError as e:
        return f"{url} unreachable ({e.strerror or e})"
    return None


class MLflow:
    """An MLflow run through ``MlflowClient`` (no active-run state is touched, so a script's
    own ``mlflow`` calls are left as they are). The server is ``MLFLOW_TRACKING_URI``; the
    experiment ``MLFLOW_EXPERIMENT_ID`` or ``MLFLOW_EXPERIMENT_NAME`` (made if missing), else
    MLflow's default."""

    name = "mlflow"

    def __init__(self):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.mlflow, self.client = mlflow, MlflowClient()
        self.run_id: str | None = None  # the MLflow run's, once started

    def start(self, saved: dict, run_name: str, settings: dict, run_dir: str) -> dict:
        from mlflow.entities import Param

        uri = self.mlflow.get_tracking_uri()
        problem = reachable(uri)
        if problem:
            raise ConnectionError(problem)
        experiment = self._experiment()
        # The job's run: by its saved id, else by the job's tag (a run made by a process
        # that was stopped before it could save the id), else a new one.
        found = (
            [self.client.get_run(saved["run_id"])]
            if saved.get("run_id")
            else self.client.search_runs(
                [experiment], f"tags.`hvdtrain.job` = '{saved['job']}'", max_results=1
            )
        )
        if found:
            run = found[0]
            self.client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                experiment,
                run_name=run_name,
                tags={"hvdtrain.run_dir": run_dir, "hvdtrain.job": saved["job"]},
            )
        self.run_id = run.info.run_id
        known, text = run.data.params, {k: str(v) for k, v in flat(settings).items()}
        params = [Param(k, v[:6000]) for k, v in text.items() if k not in known]
        for i in range(0, len(params), 100):  # log_batch takes 100 parameters at most
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        changed = {k: v for k, v in text.items() if k in known and known[k] != v[:6000]}
        for k, v in changed.items():  # a parameter cannot change; a resume with more epochs
            self.client.set_tag(self.run_id, f"hvdtrain.resumed.{k}", v)
        # The epochs the server has (a stopped process may have sent one it did not record).
        logged = [m.value for m in self.client.get_metric_history(self.run_id, "epoch")]
        return {
            "run_id": self.run_id,
            "experiment_id": run.info.experiment_id,
            "tracking_uri": uri,
            "run_name": run.info.run_name,
            "epochs_logged": int(max(logged, default=0)),
        }

    def _experiment(self) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return "0"  # MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def metrics(self, values: dict, step: int) -> None:
        from mlflow.entities import Metric

        assert self.run_id is not None  # called only on a started tracker (Trackers.live)
        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()]
        )

    def artifacts(self, paths: list) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, path)

    def end(self, status: str) -> None:
        assert self.run_id is not None  # called only on a started tracker (Trackers.live)
        self.client.set_terminated(self.run_id, status)


class Wandb:
    """A W&B run, its id kept so that ``wandb.init(id=..., resume="allow")`` continues it.
    The project is ``WANDB_PROJECT`` (else "hvdtrain"); its files go to ``WANDB_DIR``, else
    the run directory; ``WANDB_MODE=offline`` writes them without a server."""

    name = "wandb"

    def __init__(self):
        import wandb

        self.wandb, self.run = wandb, None

    def start(self, saved: dict, run_name: str, settings: dict, run_dir: str) -> dict:
        wandb = self.wandb
        mode = os.environ.get("WANDB_MODE", "online")
        if mode not in ("offline", "disabled", "dryrun"):
            problem = reachable(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
            if problem:
                raise ConnectionError(problem)
        run_id = saved.get("run_id") or saved["job"][:8]
        self.run = wandb.init(
            id=run_id,
            resume="allow",
            name=run_name,
            project=os.environ.get("WANDB_PROJECT", "hvdtrain"),
            dir=os.environ.get("WANDB_DIR", run_dir),
            reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.config.update(flat(settings), allow_val_change=True)
        return {"run_id": run_id, "project": self.run.project, "run_name": run_name, "mode": mode}

    def metrics(self, values: dict, step: int) -> None:
        assert self.run is not None  # called only on a started tracker (Trackers.live)
        self.run.log(dict(values), step=step)

    def summary(self, values: dict) -> None:
        assert self.run is not None  # called only on a started tracker (Trackers.live)
        self.run.summary.update(values)

    def artifacts(self, paths: list) -> None:
        assert self.run is not None  # called only on a started tracker (Trackers.live)
        artifact = self.wandb.Artifact(f"run-{self.run.id}", type="model")
        for path in paths:
            artifact.add_file(path)
        self.run.log_artifact(artifact)

    def end(self, status: str) -> None:
        assert self.run is not None  # called only on a started tracker (Trackers.live)
        self.run.finish(exit_code={"FINISHED": 0, "KILLED": 75}.get(status, 1))


class TensorBoard:
    """The run's settings as TensorBoard hyperparameters (its HParams dashboard compares runs
    by them), beside the epochs' scalars that every run writes to RUN_DIR/tensorboard."""

    name = "tensorboard"

    def start(self, saved: dict, run_name: str, settings: dict, run_dir: str) -> dict:
        import tensorflow as tf
        from tensorboard.plugins.hparams import api as hp

        values = {k: v for k, v in flat(settings).items() if isinstance(v, (bool, int, float, str))}
        writer = tf.summary.create_file_writer(os.path.join(run_dir, TENSORBOARD))
        with writer.as_default():
            hp.hparams(values, trial_id=run_name)
        writer.close()
        return {"run_name": run_name}

    # Its metrics are the run's own tensorboard/ event files; no artifacts, no end.
    metrics = artifacts = end = staticmethod(lambda *args: None)


BACKENDS: dict[str, type[MLflow | Wandb | TensorBoard]] = {
    "mlflow": MLflow,
    "wandb": Wandb,
    "tensorboard": TensorBoard,
}
