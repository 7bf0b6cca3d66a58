"""Experiment tracking, for real: a real MLflow tracking server (``mlflow server``, its SQLite
store and artifacts in a temporary folder, on a loopback port, stopped after the module) and
W&B offline (``WANDB_MODE=offline``, its run files read back), with 2-rank runs under
horovodrun: one tracker run per job on both paths, continued after a SIGTERM and the same
command again; an unreachable server; a plain Horovod script with MLflow's autologging and
``wandb.init()`` on every rank; chief-only callbacks that fail on rank 0.

What it costs: the server starts in about 8 s; the module's six launches about 2 minutes."""

import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import (
    ROOT,
    as_printed,
    checkout_like,
    clean_env,
    finish,
    free_port,
    launch,
    rank_pids,
    result,
    run,
    running,
    script_cmd,
    start,
    wait_for,
)
from docs_pages import block
from hvdtrain.engine.tracker_backends import flat

pytestmark = pytest.mark.timeout(420)
COMMANDS = block("guides/tracking.md", "horovodrun -np 2 python -m hvdtrain.mnist").commands()


def untagged(line: str) -> str:
    """A rank's line without horovodrun's ``[0]<stderr>:`` tag."""
    return re.sub(r"^\[\d+\]<std(out|err)>:", "", line)


def up(url) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real MLflow tracking server: the URL, its client."""
    from mlflow.tracking import MlflowClient

    d = tmp_path_factory.mktemp("mlflow")
    url = f"http://127.0.0.1:{free_port()}"
    log = open(d / "server.log", "w")
    proc = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            url.rsplit(":", 1)[1],
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{d}/mlflow.db",
            "--artifacts-destination",
            str(d / "artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true"),
    )
    try:
        assert wait_for(lambda: up(url) or proc.poll() is not None, 120) and proc.poll() is None, (
            d / "server.log"
        ).read_text()[-3000:]
        yield url, MlflowClient(url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def tracked_env(tmp_path, url, experiment):
    # MLflow's telemetry waits for a network this sandbox does not have at every exit.
    return clean_env(
        tmp_path / "home",
        extras=True,  # MLflow's client reads pandas
        MLFLOW_TRACKING_URI=url,
        MLFLOW_EXPERIMENT_NAME=experiment,
        MLFLOW_DISABLE_TELEMETRY="true",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        HVDTRAIN_PROGRESS_SECONDS="0.2",
    )


def records(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sigterm_after_first_epoch(cmd, env, cwd, printed_run_dir):
    """Start the job, SIGTERM rank 1 once an epoch is in metrics.jsonl; the job stops (75)."""
    run_dir = os.path.join(cwd, printed_run_dir)
    proc = start(cmd, env, cwd=cwd)
    try:
        pids = wait_for(
            lambda: (lambda d: d if len(d) == 2 else None)(rank_pids(printed_run_dir)), 90
        )
        assert pids and wait_for(lambda: records(run_dir), 120), "no epoch was logged"
        os.kill(pids[1], signal.SIGTERM)
        rc, out, err = finish(proc, 60)
        assert rc is not None, "the job did not end within 60 s of SIGTERM"
        assert wait_for(lambda: not any(running(p) for p in pids.values()), 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc != 0 and "stopped by SIGTERM at step" in err, err
    assert not os.path.exists(os.path.join(run_dir, "result.json")), "finished before SIGTERM"
    return records(run_dir)


def wandb_records(path):
    """The records of a W&B run file (``run-ID.wandb``: W&B's LevelDB-style log of protobuf
    records, 32 KiB blocks of chunks each with a 7-byte header, after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        chunk, pos = chunk + data[pos : pos + length], pos + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_history(run_dir, run_id):
    """Every W&B session's history rows of the run (offline: one folder per session)."""
    folders = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")))
    assert folders and all(f.endswith("-" + run_id) for f in folders), folders
    rows = []
    for folder in folders:
        for record in wandb_records(os.path.join(folder, f"run-{run_id}.wandb")):
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return folders, rows


def check_tracked(run_dir, client, experiment, first):
    """One MLflow run with config.json's settings and one point per epoch per metric, the
    artifacts, continued after the stop; one W&B run (its sessions), each epoch once."""
    epochs = records(run_dir)
    assert [r["epoch"] for r in epochs] == list(range(1, result(run_dir)["epochs"] + 1))
    assert 1 <= len(first) < len(epochs)
    saved = json.load(open(os.path.join(run_dir, "tracking.json")))
    # MLflow: one run, the settings, each epoch once at its global step, the artifacts.
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    tracked = runs[0]
    assert tracked.info.run_id == saved["mlflow"]["run_id"]
    assert tracked.info.status == "FINISHED"
    config = json.load(open(os.path.join(run_dir, "config.json")))
    assert tracked.data.params == {k: str(v) for k, v in flat(config).items()}
    for metric in ("loss", "accuracy", "epoch"):
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(tracked.info.run_id, metric)
        )
        assert history == [(r["global_step"], float(r[metric])) for r in epochs], metric
    artifacts = {a.path for a in client.list_artifacts(tracked.info.run_id)}
    assert {
        "model.keras",
        "config.json",
        "result.json",
        "metrics.jsonl",
        "checkpoints.json",
    } <= artifacts, artifacts
    # W&B offline: one run id for both sessions, each epoch once across them.
    folders, rows = wandb_history(run_dir, saved["wandb"]["run_id"])
    # A folder per session that reached W&B: the stopped one (unless it was stopped before its
    # tracker thread got to W&B) and the resumed one, all of the one run id (wandb_history).
    assert 1 <= len(folders) <= 2, folders
    logged = [(r["_step"], r["epoch"], r["loss"]) for r in rows if "epoch" in r]
    assert logged == [(r["global_step"], r["epoch"], r["loss"]) for r in epochs]
    # TensorBoard: the settings as hyperparameters, beside the scalars.
    events = b"".join(
        open(p, "rb").read() for p in glob.glob(os.path.join(run_dir, "tensorboard", "events.*"))
    )
    assert b"hparams" in events and b"learning_rate" in events


# Keras 3 only: what is tracked comes from the run engine, the same under either Keras; the
# fit path's callbacks under Keras 2 are test_keras_fit's and test_models', and Keras 2's
# tracking here is the plain Horovod script's autolog below.
@pytest.mark.parametrize("path", ["task", "fit"])
def test_the_guides_commands_track_one_run_continued_after_sigterm(path, server, tmp_path):
    """The guide's command of each path, as printed: stopped by SIGTERM after its first epoch,
    then run again: one MLflow run and one W&B run, each epoch once, continued."""
    url, client = server
    cwd = checkout_like(tmp_path / "cwd")
    line = COMMANDS[0 if path == "task" else 1]
    assert line.startswith(
        "horovodrun -np 2 python "
        + ("-m hvdtrain.mnist " if path == "task" else "examples/keras_fit_tracked.py ")
    ), line
    printed = line.split("--run-dir ")[1].split()[0]
    run_dir = cwd / printed
    env = tracked_env(tmp_path, url, path)
    first = sigterm_after_first_epoch(as_printed(line), env, str(cwd), printed)
    p = run(as_printed(line), env, cwd=str(cwd))
    assert p.returncode == 0, p.stderr
    assert "hvdtrain: resumed from" in p.stderr and "warning" not in p.stderr, p.stderr
    check_tracked(run_dir, client, path, first)
    # The periodic progress lines of a log (HVDTRAIN_PROGRESS_SECONDS): rank 0's alone.
    shown = [l for l in p.stdout.splitlines() if "epoch ETA" in l]
    assert all(
        re.match(
            r"\[(1,)?0\]<stdout>:Epoch \d+/\d+  step \d+/\d+  .* samples/s  "
            r"epoch ETA \d",
            l,
        )
        for l in shown
    ), shown
    assert shown or path == "task", p.stdout  # the Task path's epochs may take under 0.2 s


def test_an_unreachable_server_is_a_warning_and_the_same_training(tmp_path):
    """A server that is down: one warning, and the run trains to the weights it trains to
    untracked; with --track-required every rank stops before training, exit 1, one line."""
    down = f"http://127.0.0.1:{free_port()}"
    env = tracked_env(tmp_path, down, "down")
    args = ["--batch-size", "20", "--epochs", "2", "--no-download", "--verbose", "0"]
    plain = run(launch("gloo", 2, "mnist", "--run-dir", str(tmp_path / "plain"), *args), env)
    assert plain.returncode == 0, plain.stderr
    tracked = run(
        launch(
            "gloo", 2, "mnist", "--run-dir", str(tmp_path / "tracked"), *args, "--track", "mlflow"
        ),
        env,
    )
    assert tracked.returncode == 0, tracked.stderr
    warnings = [l for l in tracked.stderr.splitlines() if "warning: tracker mlflow" in l]
    assert len(warnings) == 1, tracked.stderr
    shown = block("guides/tracking.md", "hvdtrain: warning: tracker mlflow failed").text.strip()
    assert untagged(warnings[0]) == shown.replace("http://127.0.0.1:5000", down), tracked.stderr
    assert (
        result(tmp_path / "tracked")["weights_sha256"]
        == result(tmp_path / "plain")["weights_sha256"]
    )
    required = run(
        launch(
            "gloo",
            2,
            "mnist",
            "--run-dir",
            str(tmp_path / "required"),
            *args,
            "--track",
            "mlflow",
            "--track-required",
        ),
        env,
    )
    assert required.returncode == 1, required.stderr
    lines = [l for l in required.stderr.splitlines() if "tracker mlflow failed" in l]
    assert len(lines) == 1 and "--track-required" in lines[0], required.stderr
    assert not records(tmp_path / "required")  # stopped before the first epoch


@pytest.mark.keras2
def test_a_plain_horovod_script_with_autolog_and_wandb_init_makes_one_run(server, tmp_path):
    """examples/horovod_keras_autolog.py as the guide prints it: MLflow's autologging and
    wandb.init() on both ranks, one run in each."""
    url, client = server
    cwd = checkout_like(tmp_path / "cwd")
    env = tracked_env(tmp_path, url, "plain-horovod")
    (line,) = block(
        "guides/tracking.md", "horovodrun -np 2 python examples/horovod_keras_autolog"
    ).commands()
    p = run(as_printed(line), env, cwd=str(cwd))
    assert p.returncode == 0, p.stderr
    runs = client.search_runs([client.get_experiment_by_name("plain-horovod").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    assert len(client.get_metric_history(runs[0].info.run_id, "loss")) == 2  # its 2 epochs
    folders = glob.glob(str(cwd / "wandb" / "offline-run-*"))
    assert len(folders) == 1, folders


@pytest.mark.parametrize("mode", ["raise", "block"])
def test_a_chief_callback_that_fails_stops_every_rank(mode, tmp_path):
    """hk.on_chief's callback raises (or hangs past its timeout) on rank 0 at epoch 2's end:
    every rank exits 1 within the watchdog's bound, with one line naming the callback."""
    env = clean_env(tmp_path / "home")
    script = os.path.join(ROOT, "tests", "chief_callback_script.py")
    cmd = script_cmd(2, script, mode, tmp_path / "run")
    began = time.monotonic()
    p = run(cmd, env, timeout=120)
    took = time.monotonic() - began
    assert p.returncode == 1, p.stderr
    said = [l for l in p.stderr.splitlines() if "hk.on_chief callback Tracker.on_epoch_end" in l]
    assert len(said) == 1, p.stderr
    if mode == "raise":  # the guide's line, but for the script's name
        shown = block("guides/tracking.md", "train.py: error: hk.on_chief").text.strip()
        assert untagged(said[0]) == shown.replace(
            f"(train.py:{RAISE_LINE})", f"({script}:{RAISE_LINE})"
        ).replace("train.py: error", "chief_callback_script.py: error"), said[0]
    else:
        assert (
            "raised TimeoutError: did not return within 3 s (hk.on_chief's timeout) ("
            f"{script}:" in said[0]
        ), said[0]
    # Rank 0 alone ran it: its epochs, never rank 1's.
    assert "on rank 1" not in p.stdout and p.stdout.count("chief callback: epoch") == 2, p.stdout
    assert took < 60, took


RAISE_LINE = next(
    i
    for i, l in enumerate(open(os.path.join(ROOT, "tests", "chief_callback_script.py")), 1)
    if "raise RuntimeError" in l
)


def test_the_guides_callback_lines_are_the_scripts():
    """The guide's hk.on_chief excerpts are lines of the script the test above runs."""
    script = open(os.path.join(ROOT, "tests", "chief_callback_script.py")).read().splitlines()
    for excerpt in (
        block("guides/tracking.md", "class Tracker(k.callbacks.Callback)"),
        block("guides/tracking.md", "    hk.fit(model, hk.dataset("),
    ):
        for line in excerpt.text.splitlines():
            assert line in script, line


def test_an_epoch_sent_but_not_recorded_is_not_sent_again(server, tmp_path, monkeypatch):
    """A process stopped after MLflow got an epoch but before tracking.json said so (the
    moment a launcher's kill can fall in): the next run asks the server, and sends the kept
    epoch once, not twice."""
    from hvdtrain.engine.rundir import RunDir
    from hvdtrain.engine.tracking import RECORD, Trackers

    url, client = server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sent-not-recorded")
    said = []
    first = {"epoch": 1, "epochs": 2, "global_step": 10, "loss": 0.5}
    trackers = Trackers(["mlflow"], RunDir(tmp_path), False, said.append)
    trackers.start({"task": "t", "epochs": 2}, [])
    trackers.epoch(first)
    trackers.close("KILLED", seconds=60)
    saved = json.load(open(tmp_path / RECORD))
    assert saved["mlflow"]["epochs_logged"] == 1
    saved["mlflow"]["epochs_logged"] = 0  # the write the kill prevented
    (tmp_path / RECORD).write_text(json.dumps(saved))
    trackers = Trackers(["mlflow"], RunDir(tmp_path), False, said.append)
    trackers.start({"task": "t", "epochs": 2}, [first])  # metrics.jsonl's kept epoch
    trackers.epoch({"epoch": 2, "epochs": 2, "global_step": 20, "loss": 0.25})
    trackers.close("FINISHED", seconds=60)
    assert not said, said
    history = client.get_metric_history(saved["mlflow"]["run_id"], "loss")
    assert sorted((m.step, m.value) for m in history) == [(10, 0.5), (20, 0.25)]
    assert client.get_run(saved["mlflow"]["run_id"]).info.status == "FINISHED"
