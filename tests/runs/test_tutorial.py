"""The tutorial (docs/tutorials/resnet-cifar.md) as a reader follows it: its command run as
printed with the real horovodrun on two processes, once through (the uninterrupted run), and
once stopped with Ctrl-C after epoch 2's line (SIGINT to the launcher's process group, as a
terminal sends it) and run again (the stop tried once more when Open MPI cut it short, which
the page says can happen on a loaded machine); the output it prints is what those runs print, the
excerpts of examples/resnet_cifar.py it prints are the script's, and its CIFAR-10 load_data
gives what the script's synthetic one does. One launch sequence, shared by the module's tests.

Keras 3 only: the Keras 2 pass would make the three launches again (a minute or more on two
cores); under Keras 2 the fit path's exact resume after a signal is test_resume_edges',
test_models' and test_accumulate's."""

import importlib.util
import json
import math
import os
import re
import signal
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT, as_printed, checkout_like, clean_env, finish, run, start, wait_for
from docs_pages import block

PAGE = "tutorials/resnet-cifar.md"
COMMAND = block(
    "tutorials/resnet-cifar.md", "horovodrun -np 2 python examples/resnet_cifar.py"
).commands()
STOPPED = block("tutorials/resnet-cifar.md", "Epoch 1/6 - ")
RESUMED = block("tutorials/resnet-cifar.md", "hvdtrain: resumed from")
EXCERPTS = [
    block("tutorials/resnet-cifar.md", "def augment(seeds, image, label):"),
    block("tutorials/resnet-cifar.md", "def residual_block(x, filters, strides):"),
    block("tutorials/resnet-cifar.md", "    hk.init()"),
]
CIFAR = block("tutorials/resnet-cifar.md", "def load_data(samples):\n    (x_train")
SCRIPT = os.path.join(ROOT, "examples", "resnet_cifar.py")
EPOCHS, STEPS = 6, 2048 // (32 * 2)  # the command's --epochs; --samples // global batch
NUMBER = r"\d[\d,]*(?:\.\d+)?"


def metrics(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def read(run_dir, name):
    with open(os.path.join(run_dir, name)) as f:
        return json.load(f)


def checkpoint_steps(run_dir):
    names = os.listdir(os.path.join(run_dir, "checkpoints"))
    return sorted(int(n[len("ckpt-") : -len(".hvdt")]) for n in names if n.endswith(".hvdt"))


def lines(out):
    """The output's lines without horovodrun's "[1,0]<stdout>:" prefix."""
    return [re.sub(r"^\[\d+(?:,\d+)?\]<std(?:out|err)>:", "", l) for l in out.splitlines()]


def shape(line):
    """A printed line as a pattern: its numbers any numbers, /home/me any directory."""
    parts = [re.escape(p) for p in re.split(NUMBER, line.replace("/home/me", "\0"))]
    return re.compile(NUMBER.join(parts).replace(re.escape("\0"), ".+") + "$")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tutorial")
    env = clean_env(base / "home")
    [line] = COMMAND
    whole = checkout_like(base / "whole")  # the command once through
    uninterrupted = run(as_printed(line), env, timeout=180, cwd=str(whole))
    # The command stopped by Ctrl-C, then run again. Open MPI (horovodrun's launcher here)
    # kills the ranks one second after its SIGTERM: on a loaded machine a stop can need longer
    # (up to ten steps and the checkpoint), and then no stop line and no checkpoint at the stop
    # come, as the page says. Such a cut-short stop is checked for what the page promises of it
    # and the stop tried once more, in a new directory.
    for attempt in (1, 2):
        cut = checkout_like(base / f"cut{attempt}")
        run_dir = str(cut / "runs" / "resnet")
        proc = start(as_printed(line), env, cwd=str(cut))
        try:
            assert wait_for(lambda: len(metrics(run_dir)) >= 2, 150), "no epoch 2"
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: to the terminal's foreground group
        finally:
            rc, out, err = finish(proc, 120)
        stopped = SimpleNamespace(
            returncode=rc,
            stdout=out,
            stderr=err,
            metrics=metrics(run_dir),
            checkpoints=checkpoint_steps(run_dir),
            finished=os.path.exists(os.path.join(run_dir, "result.json")),
        )
        if "stopped by SIGTERM at step" in err or attempt == 2:
            break
        # Cut short: killed before the stop's checkpoint; what is left is the epochs'
        # checkpoints, the newest at the last epoch's end, from which the command resumes.
        assert rc == -signal.SIGINT and not stopped.finished, (rc, err[-3000:])
        assert stopped.checkpoints and all(c % STEPS == 0 for c in stopped.checkpoints)
        newest = max(stopped.checkpoints)  # the metrics line comes just before the checkpoint
        assert STEPS * (len(stopped.metrics) - 1) <= newest <= STEPS * len(stopped.metrics)
    resumed = run(as_printed(line), env, timeout=180, cwd=str(cut))
    return SimpleNamespace(
        uninterrupted=uninterrupted,
        whole=str(whole / "runs" / "resnet"),
        stopped=stopped,
        resumed=resumed,
        run_dir=run_dir,
    )


@pytest.fixture(scope="module")
def stop_step(runs):
    found = re.findall(
        r"stopped by SIGTERM at step (\d+); checkpoint saved in (\S+);", runs.stopped.stderr
    )
    assert len(found) == 1, runs.stopped.stderr[-3000:]
    step, where = int(found[0][0]), found[0][1]
    assert where == os.path.join(runs.run_dir, "checkpoints")
    return step


def test_the_page_runs_the_script_at_the_size_it_says():
    [line] = COMMAND
    assert line.startswith("horovodrun -np 2 python examples/resnet_cifar.py ")
    flags = dict(zip(line.split()[5::2], line.split()[6::2]))
    assert flags == {
        "--samples": "2048",
        "--width": "8",
        "--blocks": "1",
        "--epochs": "6",
        "--batch-size": "32",
        "--mixed-precision": "bfloat16",
        "--run-dir": "runs/resnet",
    }


def test_ctrl_c_stops_every_rank_at_one_step_with_a_checkpoint(runs, stop_step):
    s = runs.stopped
    assert s.returncode == -signal.SIGINT, (s.returncode, s.stderr[-3000:])  # the launcher
    assert not s.finished
    assert 2 * STEPS <= stop_step < EPOCHS * STEPS  # after epoch 2's line, before the end
    assert max(s.checkpoints) == stop_step
    assert [r["epoch"] for r in s.metrics] == list(range(1, stop_step // STEPS + 1))
    printed = [l for l in lines(s.stdout) if l.startswith("Epoch ")]
    assert len(printed) == len(s.metrics), s.stdout  # only rank 0 prints, once per epoch


def test_the_same_command_continues_where_it_stopped(runs, stop_step):
    r, s = runs.resumed, runs.stopped
    assert r.returncode == 0, r.stderr[-3000:]
    first = stop_step // STEPS + 1  # the epoch the stop fell in
    epochs = [int(l.split()[1].split("/")[0]) for l in lines(r.stdout) if l.startswith("Epoch ")]
    assert epochs == list(range(first, EPOCHS + 1)), r.stdout  # nothing trained twice
    records = metrics(runs.run_dir)
    assert [m["epoch"] for m in records] == list(range(1, EPOCHS + 1))  # each epoch once
    assert records[: len(s.metrics)] == s.metrics  # the first run's lines kept as they were
    assert [m["global_step"] for m in records] == [STEPS * e for e in range(1, EPOCHS + 1)]
    res = read(runs.run_dir, "result.json")
    assert res["epochs"] == EPOCHS and res["global_step"] == EPOCHS * STEPS
    assert res["world_size"] == 2 and res["ranks_identical"] is True
    assert res["batch_size"] == 32 and res["global_batch_size"] == 64
    assert res["sharding"] == "data" and res["examples_left_out"] == 0
    said = (
        f"hvdtrain: resumed from {runs.run_dir}/checkpoints/ckpt-{stop_step:09d}.hvdt at "
        f"epoch {first}, step {stop_step}"
    )
    assert said in lines(r.stderr), r.stderr[-3000:]
    steps = checkpoint_steps(runs.run_dir)
    assert len(steps) == 3 and steps[-1] == EPOCHS * STEPS  # the newest 3, one at the end
    assert os.path.exists(os.path.join(runs.run_dir, "model.keras"))
    assert os.listdir(os.path.join(runs.run_dir, "tensorboard"))


def test_it_learns_and_ends_as_the_run_that_was_not_stopped(runs):
    assert runs.uninterrupted.returncode == 0, runs.uninterrupted.stderr[-3000:]
    whole, cut = read(runs.whole, "result.json"), read(runs.run_dir, "result.json")
    assert whole["weights_sha256"] == cut["weights_sha256"]
    a, b = metrics(runs.whole), metrics(runs.run_dir)
    assert len(a) == len(b) == EPOCHS
    for x, y in zip(a, b):  # every epoch's numbers, the one cut in two included (bfloat16
        # evaluation: the same weights score within float32 round-off of the sums' order)
        for k in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), (x["epoch"], k)
    # Learnable data: well above chance (accuracy 0.1, loss ln 10 = 2.30).
    assert a[0]["loss"] < math.log(10) and a[-1]["loss"] < a[0]["loss"] / 4
    assert a[-1]["accuracy"] > 0.9 and a[-1]["val_accuracy"] > 0.9
    config = read(runs.whole, "config.json")
    assert config["mixed_precision"] == "bfloat16" and config["momentum"] == 0.9


def test_the_printed_output_is_what_the_runs_print(runs, stop_step):
    for printed, out in (
        (STOPPED, runs.stopped.stdout + "\n" + runs.stopped.stderr),
        (RESUMED, runs.resumed.stdout + "\n" + runs.resumed.stderr),
    ):
        assert printed.lang == "text"
        real = lines(out)
        for line in printed.text.splitlines():
            assert any(shape(line).match(l) for l in real), (line, out[-3000:])
    # The page's numbers are those of one such run: the stop after epoch 2, six epochs.
    text = STOPPED.text + RESUMED.text
    assert re.findall(r"Epoch (\d)/6", text) == [str(e) for e in range(1, EPOCHS + 1)]
    step = int(re.search(r"at step (\d+);", text).group(1))
    assert f"ckpt-{step:09d}.hvdt at epoch {step // STEPS + 1}, step {step}" in text


def test_the_page_prints_the_scripts_code():
    source = open(SCRIPT).read()
    for b in EXCERPTS:
        assert b.lang == "python" and b.text in source, b


def test_the_cifar10_load_data_gives_what_the_script_takes(monkeypatch):
    """The page's replacement, on arrays shaped as keras.datasets.cifar10.load_data()'s
    (uint8 images, labels of shape (n, 1)): the same kinds of arrays as the synthetic
    data's, and the script's pipeline makes batches of them."""
    spec = importlib.util.spec_from_file_location("resnet_cifar_tutorial", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    synthetic = script.load_data(100)
    rng = np.random.default_rng(0)
    fake = (
        (
            rng.integers(0, 256, (300, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, (300, 1), dtype=np.uint8),
        ),
        (
            rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, (60, 1), dtype=np.uint8),
        ),
    )
    cifar10 = SimpleNamespace(load_data=lambda: fake)
    keras_module = SimpleNamespace(datasets=SimpleNamespace(cifar10=cifar10))
    monkeypatch.setattr(script, "keras", lambda: keras_module)
    exec(CIFAR.text, script.__dict__)
    (x, y), (xt, yt) = script.load_data(100)
    assert len(CIFAR.text.splitlines()) == 3
    for mine, theirs in ((x, synthetic[0][0]), (xt, synthetic[1][0])):  # images
        assert mine.dtype == theirs.dtype == np.uint8
        assert mine.shape[1:] == theirs.shape[1:] == (32, 32, 3)
    for mine, theirs in ((y, synthetic[0][1]), (yt, synthetic[1][1])):  # labels 0 to 9
        assert (
            mine.ndim == theirs.ndim == 1 and mine.dtype.kind in "iu" and theirs.dtype.kind in "iu"
        )
    assert len(x) == len(y) == 100 and len(xt) == len(yt) == 60
    assert (y == fake[0][1][:100, 0]).all() and (xt == fake[1][0]).all()
    images, labels = next(iter(script.pipeline(x, y, 32, training=True)))
    assert images.shape == (32, 32, 32, 3) and labels.shape == (32,)
    assert 0 <= float(images.numpy().min()) and float(images.numpy().max()) <= 1
